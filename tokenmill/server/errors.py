"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Status codes: 400 bad input (the message names the field; context-length errors give both numbers),
401 missing or wrong API key, 404 unknown model or route, 413 body too large, 429 waiting queue (or
the tier's queue) full, with a ``Retry-After`` header, 500 engine fault, 503 engine gone. Route handlers raise ``APIError``; the handlers installed by
``install_error_handlers`` turn it, FastAPI's validation errors and Starlette's HTTP errors into
that shape.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.frontend.async_llm import EngineDeadError, EngineFaultError, RequestRejectedError
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
    if isinstance(exc, EngineDeadError):
        return APIError(
            503, f"the engine is not available: {exc}", type="server_error", code="engine_unavailable"
        )
    if isinstance(exc, EngineFaultError):
        return APIError(500, str(exc), type="server_error", code="engine_fault")
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
        return bad_request(f"the request body is not valid JSON: {first.get('msg', '')}").response()
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


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return APIError(500, "internal server error", type="server_error", code="internal_error").response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
