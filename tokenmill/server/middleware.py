"""ASGI middleware: API-key check and request-body size limit, both answering in OpenAI's error shape.

They are plain ASGI (not Starlette's ``BaseHTTPMiddleware``) so streaming responses and client
disconnects pass through them untouched.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.server.errors import APIError

# Routes anyone may call without the key (load balancers and orchestrators probe them).
UNAUTHENTICATED_PATHS = frozenset({"/health"})


async def _send_error(send: Send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value)
    return None


class APIKeyMiddleware:
    """Require ``Authorization: Bearer <key>`` with one of ``api_keys`` on every route but
    ``UNAUTHENTICATED_PATHS``, ``public_paths`` and paths under ``public_prefixes`` (the web UI's
    pages). Each key is also a fair-share identity (``server/identity.py``)."""

    def __init__(
        self,
        app: ASGIApp,
        api_keys: list[str],
        public_paths: frozenset[str] = frozenset(),
        public_prefixes: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.expected = [f"Bearer {key}".encode() for key in api_keys]
        self.public_paths = UNAUTHENTICATED_PATHS | public_paths
        self.public_prefixes = public_prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in self.public_paths or path.startswith(self.public_prefixes):
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"authorization") or b""
        # Compare with every key (no early exit), so timing does not tell which key came close.
        matches = [hmac.compare_digest(given, expected) for expected in self.expected]
        if not any(matches):
            message = "missing API key" if not given else "incorrect API key provided"
            error = APIError(401, message, param=None, code="invalid_api_key")
            await _send_error(send, error)
            return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Answer 413 when a request body is larger than ``max_bytes``.

    A declared ``Content-Length`` is checked before anything is read. A chunked body is counted as
    it arrives; once over the limit, the app's own answer (FastAPI turns the failed read into a 400)
    is replaced by the 413.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: int | str) -> APIError:
        return APIError(
            413,
            f"the request body is {size} bytes; the limit is {self.max_bytes} bytes",
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _send_error(send, self._too_large(int(declared)))
            return
        received = 0
        overflowed = False

        async def limited_receive() -> Message:
            nonlocal received, overflowed
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    overflowed = True
                    raise ValueError("request body too large")
            return message

        async def guarded_send(message: Message) -> None:
            if not overflowed:
                await send(message)
            elif message["type"] == "http.response.start":
                await _send_error(send, self._too_large(f"at least {received}"))

        await self.app(scope, limited_receive, guarded_send)
