"""ASGI middleware: API-key check and request-body size limit, both answering in OpenAI's error shape.

They are plain ASGI (not Starlette's ``BaseHTTPMiddleware``) so streaming responses and client
disconnects pass through them untouched.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.server.errors import APIError, send_api_error

# Routes anyone may call without the key (load balancers and orchestrators probe them).
UNAUTHENTICATED_PATHS = frozenset({"/health"})


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
            await send_api_error(send, error)
            return
        await self.app(scope, receive, send)


class RequestBodyMiddleware:
    """Read each request's whole body before the app runs, and refuse bad ones early.

    - over ``max_bytes`` → 413 (a declared ``Content-Length`` is checked before anything is read; a
      chunked body is counted as it arrives). The rest of the body is discarded by the HTTP layer and
      the keep-alive connection stays usable.
    - not complete ``read_timeout`` seconds after the headers → 408 with ``Connection: close`` (a
      slow-loris client trickling its body does not hold the server's memory or a task forever).
    - a JSON body with a string that is not valid Unicode (an unpaired UTF-16 surrogate, escaped as
      ``"\\ud800"`` or raw) → 400, before any route sees it (``json_body_error``).

    The app then receives the body as one message; later ``receive`` calls (disconnect detection
    while streaming) go to the server as usual.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout = read_timeout

    def _too_large(self, size: int | str) -> APIError:
        return APIError(
            413,
            f"the request body is {size} bytes; the limit is {self.max_bytes} bytes",
            code="request_too_large",
        )

    async def _read_body(self, receive: Receive) -> bytes | APIError:
        """The whole body, or the error to answer instead."""
        chunks: list[bytes] = []
        received = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                return APIError(
                    408,
                    f"the request body did not arrive within {self.read_timeout:g} s",
                    code="request_timeout",
                    headers={"Connection": "close"},
                )
            if message["type"] != "http.request":  # the client went away mid-body
                return APIError(400, "the client disconnected before sending the whole body")
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > self.max_bytes:
                return self._too_large(f"at least {received}")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await send_api_error(send, self._too_large(int(declared)))
            return
        body = await self._read_body(receive)
        if isinstance(body, APIError):
            await send_api_error(send, body)
            return
        content_type = (_header(scope, b"content-type") or b"application/json").lower()
        if b"json" in content_type:
            problem = json_body_error(body)
            if problem is not None:
                where, message = problem
                error = APIError(400, message, param=where or None, code="invalid_unicode")
                await send_api_error(send, error)
                return
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


# An escaped UTF-16 surrogate (``\\ud800``..``\\udfff``) or one encoded raw in the bytes (which
# Python's JSON reader lets through as "surrogatepass"). Either is rare in real bodies, so the
# exact check below runs only when this quick scan finds one.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def json_body_error(body: bytes) -> tuple[str, str] | None:
    """Where (``messages.0.content``; empty for a key) and why ``body`` (JSON) cannot be accepted as
    text, or None.

    JSON allows any ``\\uXXXX`` escape, so a string may decode to an unpaired surrogate, which is not
    Unicode: tokenizers, logs and the JSON answer quoting the field all fail on it. Bodies that are
    not valid JSON pass (the route answers them with its own 400).
    """
    if _MAYBE_SURROGATE.search(body) is None:
        return None
    try:
        value = json.loads(body)
    except ValueError:
        return None
    found = _first_surrogate(value, "")
    if found is None:
        return None
    where, char = found
    place = f"in {where}" if where else "in the body"
    surrogate = f"\\u{ord(char):04x}"
    return (
        where,
        f"{place}: the string holds an unpaired UTF-16 surrogate ({surrogate}), which is not valid Unicode",
    )


def _first_surrogate(value: object, where: str) -> tuple[str, str] | None:
    """The path (``messages.0.content``) and character of the first unpaired surrogate in ``value``."""
    if isinstance(value, str):
        bad = _SURROGATE.search(value)
        return (where, bad.group()) if bad else None
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{where}.{key}" if where else str(key)
            found = _first_surrogate(key, where) or _first_surrogate(item, path)
            if found is not None:
                return found
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = _first_surrogate(item, f"{where}.{index}" if where else str(index))
            if found is not None:
                return found
    return None


_SURROGATE = re.compile("[\ud800-\udfff]")
