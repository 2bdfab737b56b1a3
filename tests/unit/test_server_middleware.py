"""The last-resort error middleware and the JSON Unicode check, on raw ASGI messages."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.types import Message, Receive, Scope, Send

from tokenmill.server.errors import UnexpectedErrorMiddleware
from tokenmill.server.middleware import json_body_error

SCOPE: Scope = {"type": "http", "method": "POST", "path": "/x", "headers": []}


def run(app: UnexpectedErrorMiddleware) -> list[Message]:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    asyncio.run(app(SCOPE, receive, send))  # must not raise: a raise makes uvicorn drop the connection
    return sent


def test_an_exception_before_the_answer_is_a_500_in_openai_shape() -> None:
    async def broken(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("boom")

    start, body = run(UnexpectedErrorMiddleware(broken))
    assert start["status"] == 500
    assert json.loads(body["body"])["error"]["code"] == "internal_error"


def test_an_exception_mid_stream_ends_the_chunked_body() -> None:
    async def broken_stream(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        raise BaseException("a Rust panic is a BaseException")  # noqa: TRY002

    sent = run(UnexpectedErrorMiddleware(broken_stream))
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


def test_cancellation_is_not_swallowed() -> None:
    async def cancelled(scope: Scope, receive: Receive, send: Send) -> None:
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        run(UnexpectedErrorMiddleware(cancelled))


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"a": "x\\ud800"}', "a"),
        (b'{"a": ["ok", {"b": "\\udc00"}]}', "a.1.b"),
        (b'{"\\ud800": 1}', ""),
        ('{"a": "\udc80"}'.encode("utf-8", "surrogatepass"), "a"),
        (b'{"a": "\\ud83d\\ude00"}', None),  # a proper pair
        (b'{"a": "\\\\ud800"}', None),  # an escaped backslash, then letters
        (b'{"a": "\\ud800', None),  # not JSON: the route answers it
    ],
)
def test_json_body_error_finds_unpaired_surrogates(body: bytes, expected: str | None) -> None:
    found = json_body_error(body)
    assert (found[0] if found else None) == expected
