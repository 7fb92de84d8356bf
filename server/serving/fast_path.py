"""The trainer's calls without FastAPI's request machinery.

``POST /episodes``, ``POST /episodes/{episode_id}/step`` and ``DELETE /episodes/{episode_id}`` are
answered by :class:`EpisodeFastPath` when they succeed (the same bytes the routes would send);
everything else falls through to the routes' own answer. :class:`FastJSONRoute` parses the other
routes' JSON bodies with the standard library's decoder and :class:`JSONBytesResponse` sends
ready-made bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.dental_environment import StepwiseDentalEnvironment
from server.errors import (
    InvalidActionError,
    NoEpisodeError,
    RequestRejectedError,
    StageConflictError,
    UnknownEpisodeError,
)
from server.serving.handlers import server_error_response
from server.serving.models import (
    MAX_EPISODE_ID_CHARS,
    DentalAction,
    EpisodeResetRequest,
)
from server.serving.serialization import (
    ObservationEncoder,
    decode_json_body,
    encode_json,
)


class FastJSONRequest(Request):
    """A request whose JSON body is parsed by :func:`server.serving.serialization.decode_json_body`."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = decode_json_body(await self.body())
        return self._json


class FastJSONRoute(APIRoute):
    """FastAPI route whose handler sees :class:`FastJSONRequest` (FastAPI's custom-request
    pattern): the body of a step is parsed about ten times faster than by ``json.loads``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def fast_json_handler(request: Request) -> Response:
            return await handler(FastJSONRequest(request.scope, request.receive))

        return fast_json_handler


class JSONBytesResponse(Response):
    """A JSON response encoded by :func:`server.serving.serialization.encode_json` (orjson, NaN refused)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return encode_json(content)


_REFUSED_BEFORE_APPLYING = (
    InvalidActionError,
    NoEpisodeError,
    RequestRejectedError,
    StageConflictError,
    UnknownEpisodeError,
)
"""What ``StepwiseDentalEnvironment.step`` and ``.reset`` raise before they change anything."""


class EpisodeFastPath:
    """The episode routes a trainer calls every step, without FastAPI's request machinery:
    ``POST /episodes`` (reset), ``POST /episodes/{episode_id}/step`` and ``DELETE
    /episodes/{episode_id}``.

    Routing through FastAPI's middleware stack and dependency solving cost more server time
    than the environment's step itself. This answers such a request here when its body is
    declared (``Content-Length``, none for DELETE) within the message limit and is JSON
    (``application/json`` or no content type) that the route's model validates (pydantic, as
    the route does), and the store does what is asked: 200 with the bytes the route would send
    (observations by :class:`server.serving.serialization.ObservationEncoder`), or for a server bug the
    app's own 500. Any other request goes on to the app with its body, and so does one the
    store refuses (it has changed nothing; the app then refuses it again, with its status and
    words): every answer but a success is the app's. The routes stay the app's, in its OpenAPI.
    """

    def __init__(
        self, app: ASGIApp, store: StepwiseDentalEnvironment, encoder: ObservationEncoder, max_body_bytes: int
    ):
        self.app = app
        self.store = store
        self.encoder = encoder
        self.max_body_bytes = int(max_body_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self._route(scope)
        if route is None:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            if size > self.max_body_bytes or not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        response = None
        if size <= self.max_body_bytes:
            response = self._answer(route[0], route[1], body, scope["path"])
        await (self.app if response is None else response)(scope, replay, send)

    def _route(self, scope: Scope) -> tuple[str, str] | None:
        """``(what, episode_id)`` of a request this path may answer ("reset", "step" or
        "close"; the id empty for a reset); None for anything else."""
        if scope["type"] != "http" or scope.get("root_path"):
            return None
        method, path = scope["method"], scope["path"]
        if method == "POST" and path.endswith("/step") and path.startswith("/episodes/"):
            what, episode_id = "step", path[10:-5]
        elif method == "POST" and path == "/episodes":
            what, episode_id = "reset", ""
        elif method == "DELETE" and path.startswith("/episodes/"):
            what, episode_id = "close", path[10:]
        else:
            return None
        if what != "reset" and (not 0 < len(episode_id) <= MAX_EPISODE_ID_CHARS or "/" in episode_id):
            return None
        length = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
            elif name == b"content-type":
                if value.lower() != b"application/json":
                    return None
            elif name == b"transfer-encoding":
                return None
        if what == "close":  # no body
            return (what, episode_id) if length in (None, b"0") else None
        if length is None or not length.isdigit() or int(length) > self.max_body_bytes:
            return None
        return what, episode_id

    def _answer(self, what: str, episode_id: str, body: bytes, path: str) -> Response | None:
        """The response to a request done here, or None (the app answers)."""
        if what == "close":
            if not self.store.close_episode(episode_id):
                return None  # the app's 404 says why it is gone
            return Response(
                encode_json({"episode_id": episode_id, "closed": True}), media_type="application/json"
            )
        try:
            data = orjson.loads(body) if body or what == "step" else {}
            if what == "reset":
                params = EpisodeResetRequest.model_validate(data)
            else:
                action = DentalAction.model_validate(data)
        except (orjson.JSONDecodeError, ValidationError):
            return None
        try:
            if what == "reset":
                obs = self.store.reset(**params.reset_kwargs())
            else:
                obs = self.store.step(
                    episode_id,
                    action.poses_array(),
                    strategy=action.strategy,
                    expected_stage=action.expected_stage,
                )
        except _REFUSED_BEFORE_APPLYING:
            return None
        except Exception as exc:  # a server bug, after the store may have changed: answered here
            return server_error_response(path, exc)
        try:
            return Response(self.encoder.encode(obs), media_type="application/json")
        except Exception as exc:
            return server_error_response(path, exc)
