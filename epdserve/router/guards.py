"""ASGI guards in front of the HTTP API: the request body size limit and the API key.

Both answer with OpenAI's error body before any endpoint runs.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from epdserve.router.protocol import error_response

DEFAULT_MAX_REQUEST_BYTES = 64 << 20
# Paths open without the API key; METRICS_PATHS are open too under --public-metrics.
OPEN_PATHS = frozenset({"/health"})
METRICS_PATHS = frozenset({"/metrics", "/v1/workers", "/v1/roles", "/v1/traffic"})


class BodySizeLimit:
    """Refuses a request whose body is larger than ``max_bytes`` with a 413: at once when its
    Content-Length says so, else as soon as the bytes received pass the limit (a chunked body).
    The body is read here, at most ``max_bytes`` of it, and handed on in the same messages."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and (not declared.isdigit() or len(declared) > 20):
            await error_response(400, "Content-Length is not a number")(scope, receive, send)
            return
        if declared is not None and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        messages: list[Message] = []
        num_bytes = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client went away
                break
            num_bytes += len(message.get("body", b""))
            if num_bytes > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the request body is larger than this server's limit of {self.max_bytes} bytes (--max-request-bytes)"
        await error_response(413, message, param="body")(scope, receive, send)


class ApiKeyAuth:
    """Every path but /health needs ``Authorization: Bearer KEY`` (compared in constant time);
    with ``public_metrics``, /metrics and /v1/workers do not either."""

    def __init__(self, app: ASGIApp, api_key: str, public_metrics: bool = False) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = OPEN_PATHS | (METRICS_PATHS if public_metrics else frozenset())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        # Header values are bytes on the wire (latin-1 in Starlette); compare them as bytes.
        given = Headers(scope=scope).get("authorization", "").encode("latin-1")
        if not hmac.compare_digest(given, self.expected):
            await error_response(401, "invalid or missing API key")(scope, receive, send)
            return
        await self.app(scope, receive, send)
