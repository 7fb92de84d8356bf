"""Request-body limit: a body over the message limit is refused with 413 before it is read whole."""

from __future__ import annotations

from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.serving.mcp_tools import oversized_answer
from server.serving.settings import ENV_VARIABLES


class BodyLimitMiddleware:
    """Refuses HTTP request bodies above ``max_body_bytes`` with 413: from ``Content-Length``
    before reading, and while reading (chunked bodies). (WebSocket frames: the same limit,
    in :mod:`server.serving.sessions`.)"""

    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = int(max_body_bytes)

    def _too_large(self, size: str) -> str:
        return (
            f"request body too large: {size} exceeds the limit of {self.max_body_bytes} bytes "
            f"(the server sets it with {ENV_VARIABLES['max_message_bytes']})"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > limit:
                    message = self._too_large(f"Content-Length {declared}")
                    response = (
                        Response(oversized_answer(message), status_code=413, media_type="application/json")
                        if scope.get("path") == "/mcp"  # a JSON-RPC error, as the endpoint's others
                        else JSONResponse({"detail": message}, status_code=413)
                    )
                    await response(scope, receive, send)
                    return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise StarletteHTTPException(
                        status_code=413, detail=self._too_large(f"at least {received} bytes")
                    )
            return message

        await self.app(scope, limited_receive, send)
