"""Errors as JSON ``{"detail": ...}`` naming the problem, and the OpenAPI schema's error bodies.

Validation and refused actions 422; unknown, closed, evicted or expired episodes 404 (``reason``
says which); a step for another stage than ``expected_stage``, or without an episode, 409. Bad
input never yields a 500, and a non-finite number in an output is reported as a server error
instead of being serialised as ``null``.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError, ResponseValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.errors import (
    InvalidActionError,
    NoEpisodeError,
    RequestRejectedError,
    StageConflictError,
    UnknownEpisodeError,
)
from server.json_values import NonFiniteOutputError
from server.serving.models import (
    DentalAction,
    ResetParams,
)
from server.serving.serialization import (
    describe_validation_errors,
    json_safe,
    safe_errors,
    short_repr,
)

logger = logging.getLogger("server.app")


def error_response(status_code: int, detail: Any, **extra: Any) -> JSONResponse:
    return JSONResponse({"detail": json_safe(detail), **json_safe(extra)}, status_code=status_code)


def server_error_response(path: str, exc: Exception) -> JSONResponse:
    """The 500 of a server bug (bad input never gets here), logged; JSON so clients can show
    the reason. A non-finite number in an output is named as such."""
    if isinstance(exc, NonFiniteOutputError):
        logger.error("non-finite output on %s: %s", path, exc)
        return error_response(500, f"internal error: {exc}")
    logger.error("internal error on %s", path, exc_info=exc)
    return error_response(500, f"internal error: {type(exc).__name__}: {short_repr(str(exc))}")


def install_exception_handlers(app: FastAPI) -> None:
    """JSON-safe handlers: a bad request gets a 4xx naming the problem, never a 500."""

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        return error_response(422, describe_validation_errors(errors), errors=safe_errors(errors))

    @app.exception_handler(ValidationError)
    async def _pydantic_validation(request: Request, exc: ValidationError) -> JSONResponse:
        errors = exc.errors()
        return error_response(422, describe_validation_errors(errors), errors=safe_errors(errors))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail
        cause = exc.__cause__
        if exc.status_code == 400 and isinstance(cause, UnicodeDecodeError):
            # FastAPI answers undecodable bodies with a bare 400 "error parsing the body"
            return error_response(
                422, f"body is not valid JSON: not UTF-8 text ({cause.reason} at byte {cause.start})"
            )
        if isinstance(detail, list) and detail and all(isinstance(e, dict) and "loc" in e for e in detail):
            # openenv's /step raises HTTPException(422, detail=ValidationError.errors())
            return error_response(
                exc.status_code, describe_validation_errors(detail), errors=safe_errors(detail)
            )
        return JSONResponse(
            {"detail": json_safe(detail)}, status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(InvalidActionError)
    async def _invalid_action(request: Request, exc: InvalidActionError) -> JSONResponse:
        return error_response(422, str(exc))

    @app.exception_handler(RequestRejectedError)
    async def _rejected(request: Request, exc: RequestRejectedError) -> JSONResponse:
        return error_response(422, str(exc))

    @app.exception_handler(UnknownEpisodeError)
    async def _unknown_episode(request: Request, exc: UnknownEpisodeError) -> JSONResponse:
        return error_response(404, str(exc), reason=exc.reason)

    @app.exception_handler(StageConflictError)
    async def _stage_conflict(request: Request, exc: StageConflictError) -> JSONResponse:
        return error_response(409, str(exc), current_stage=exc.current_stage)

    @app.exception_handler(NoEpisodeError)
    async def _no_episode(request: Request, exc: NoEpisodeError) -> JSONResponse:
        return error_response(409, str(exc))

    @app.exception_handler(NonFiniteOutputError)
    async def _non_finite(request: Request, exc: NonFiniteOutputError) -> JSONResponse:
        return server_error_response(request.url.path, exc)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return server_error_response(request.url.path, exc)

    @app.exception_handler(ResponseValidationError)
    async def _bad_response(request: Request, exc: ResponseValidationError) -> JSONResponse:
        logger.error("invalid response on %s: %s", request.url.path, exc)
        return error_response(
            500, "internal error: the server produced an invalid response: " + str(exc)[:500]
        )


def patch_openapi(app: FastAPI) -> None:
    """Point OpenEnv's ``/step`` action (a bare object in openenv-core) and ``/reset`` body at
    the real schemas, so fuzzers and clients see the action's shape."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        schema = original()
        if schema.get("x-orthorl-patched"):
            return schema
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        action_schema = DentalAction.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in action_schema.pop("$defs", {}).items():
            components.setdefault(name, sub)
        action_name = next((n for n in ("DentalAction", "DentalAction-Input") if n in components), None)
        if action_name is None:
            action_name = "DentalAction"
            components[action_name] = action_schema
        step_request = components.get("StepRequest")
        if step_request is not None:
            step_request["properties"]["action"] = {
                "$ref": f"#/components/schemas/{action_name}",
                "description": "the next stage's 28x7 poses and optional strategy",
            }
        reset_request = components.get("ResetRequest")
        if reset_request is not None:
            params = ResetParams.model_json_schema(ref_template="#/components/schemas/{model}")
            props = params["properties"]
            reset_request["properties"] = {**reset_request.get("properties", {}), **props}
            reset_request["additionalProperties"] = False
        schema["x-orthorl-patched"] = True
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
