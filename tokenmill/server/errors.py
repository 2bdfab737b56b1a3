"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Status codes: 400 bad input (the message names the field; context-length errors give both numbers),
401 missing or wrong API key, 404 unknown model or route, 408 body not received in time, 413 body
too large, 429 waiting queue (or the tier's queue) full, with a ``Retry-After`` header, 500 engine
fault on a request, 503 engine gone (also for requests in flight when it died). Route handlers
raise ``APIError``; the handlers installed by ``install_error_handlers`` turn it, FastAPI's
validation errors and Starlette's HTTP errors into that shape, and any other exception into a 500
that leaves the keep-alive connection open.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.frontend.async_llm import (
    EngineDeadError,
    EngineFaultError,
    EngineGoneError,
    RequestRejectedError,
)
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_SAMPLING_FIELDS = set(SamplingParams.__dataclass_fields__)


class APIError(Exception):
    """An error to send to the client as-is."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def from_value_error(exc: ValueError, prompt_param: str) -> APIError:
    """A 400 for a ValueError from parameter or prompt checks, with ``param`` filled in when known.

    Context-window errors carry code ``context_length_exceeded`` and point at the prompt field.
    """
    message = str(exc)
    if "context length" in message or "context window" in message or "KV cache" in message:
        return bad_request(message, param=prompt_param, code="context_length_exceeded")
    first_word = message.split(" ", 1)[0]
    param = first_word if first_word in _SAMPLING_FIELDS else None
    if message.startswith("prompt") or message.startswith("the prompt"):
        param = prompt_param
    return bad_request(message, param=param)


def from_engine_error(exc: Exception, prompt_param: str) -> APIError:
    """Map the errors ``AsyncLLM`` raises to their HTTP status."""
    if isinstance(exc, RequestRejectedError):
        if exc.overloaded:
            # Retry-After in whole seconds (RFC 9110), as OpenAI's own 429s carry it.
            retry_after = str(max(1, math.ceil(exc.retry_after or 1)))
            return APIError(
                429,
                str(exc),
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": retry_after},
            )
        return from_value_error(exc, prompt_param)
    if isinstance(exc, EngineDeadError | EngineGoneError):
        return APIError(
            503, f"the engine is not available: {exc}", type="server_error", code="engine_unavailable"
        )
    if isinstance(exc, EngineFaultError):
        return APIError(500, str(exc), type="server_error", code="engine_fault")
    if isinstance(exc, OverflowError):  # an integer too large to cross to the engine process
        return bad_request(f"a number in the request is out of range: {exc}")
    if isinstance(exc, ValueError):
        return from_value_error(exc, prompt_param)
    logger.error("unexpected error from the engine client", exc_info=exc)
    return APIError(500, "internal server error", type="server_error", code="internal_error")


def _validation_param(loc: tuple[Any, ...]) -> str:
    """``("body", "messages", 0, "role")`` → ``messages.0.role``; stops at pydantic's union-branch names
    of plain types and skips those of models (capitalised class names)."""
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, str) and ("[" in item or item in ("str", "int", "float", "bool", "list", "dict")):
            break
        if isinstance(item, str) and item[:1].isupper():
            continue
        parts.append(str(item))
    return ".".join(parts)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request").response()
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error") or first.get("msg", "")
        return bad_request(f"the request body is not valid JSON: {reason}").response()
    param = _validation_param(tuple(first.get("loc", ())))
    if first.get("type") == "missing":
        return bad_request(f"{param}: this field is required", param=param).response()
    if first.get("type") == "extra_forbidden":
        return bad_request(f"{param}: unrecognized request argument", param=param).response()
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else str(first.get("msg"))
    return bad_request(message, param=param or None).response()


async def _on_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
        return APIError(404, message, code="not_found").response()
    if exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
        return APIError(405, message, code="method_not_allowed").response()
    return APIError(exc.status_code, str(exc.detail)).response()


def _internal_error() -> APIError:
    return APIError(500, "internal server error", type="server_error", code="internal_error")


# Exceptions that end the task itself (cancellation, shutdown) rather than report a failed request.
_NOT_REQUEST_FAILURES = (asyncio.CancelledError, KeyboardInterrupt, SystemExit, GeneratorExit)


class UnexpectedErrorMiddleware:
    """Answer any exception a route lets escape with a 500 in OpenAI's shape, keeping the connection.

    Starlette's own last-resort handler sends the 500 and then re-raises, which makes the HTTP server
    close the keep-alive connection: a pooled client would see its *next*, unrelated request fail.
    Here the exception is logged and the request ends normally instead. A failure after the
    response started ends a chunked (streamed) body cleanly; a body of declared length cannot be
    finished, so then the exception goes on (and the connection closes, as it must).
    ``BaseException`` is caught too (Rust extensions such as tokenizers raise ``PanicException``).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False
        complete = False
        fixed_length = False

        async def tracking_send(message: Message) -> None:
            nonlocal started, complete, fixed_length
            if message["type"] == "http.response.start":
                started = True
                fixed_length = any(k.lower() == b"content-length" for k, _ in message.get("headers", []))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except _NOT_REQUEST_FAILURES:
            raise
        except BaseException as exc:
            logger.error("unhandled error on %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
            if not started:
                await send_api_error(send, _internal_error())
            elif not complete and not fixed_length:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            elif not complete:
                raise


async def send_api_error(send: Send, error: APIError) -> None:
    """Send ``error`` as a whole response over raw ASGI (for middleware, outside FastAPI's handlers)."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-shaped answers for every error; call before adding other middleware (this one must
    be innermost, so errors raised by the routes never reach Starlette's connection-closing handler)."""
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_middleware(UnexpectedErrorMiddleware)
