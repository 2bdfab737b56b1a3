"""Plumbing shared by the serving modules: SSE framing, client-disconnect detection, running streams.

Disconnect contract: whatever a handler is waiting for (acceptance, a whole non-streamed answer, the
next streamed chunk), a client that goes away cancels it, and cancelling a ``generate`` iterator
aborts the request in the engine, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenmill.frontend.output_processor import RequestState

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event carrying ``payload`` as JSON."""
    text = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {text}\n\n"


class ClientDisconnected(Exception):
    """The HTTP client went away before the answer was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read already, so the next ASGI message can only be the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable``; if the client disconnects first, cancel it and raise ClientDisconnected."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        raise ClientDisconnected
    return work.result()


async def _first_items(streams: list[AsyncGenerator[RequestState, None]]) -> list[RequestState]:
    tasks = [asyncio.ensure_future(anext(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        # Cancelling a stream mid-wait aborts its request; the others must not run on their own.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
        raise


async def open_streams(
    request: Request, streams: list[AsyncGenerator[RequestState, None]]
) -> list[RequestState]:
    """Wait until the engine has accepted every stream (all or none); returns their states.

    Raises the first stream's error (ValueError, RequestRejectedError, EngineDeadError...) or
    ClientDisconnected, after closing every stream.
    """
    return await unless_disconnected(request, _first_items(streams))


async def _drain(stream: AsyncGenerator[RequestState, None]) -> None:
    async for _ in stream:
        pass


async def finish_streams(request: Request, streams: list[AsyncGenerator[RequestState, None]]) -> None:
    """Run every stream to its end (non-streamed answers); on error or disconnect, abort them all."""
    tasks = [asyncio.ensure_future(_drain(s)) for s in streams]

    async def run_all() -> None:
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    await unless_disconnected(request, run_all())


async def merge_streams(
    streams: list[AsyncGenerator[RequestState, None]],
) -> AsyncIterator[tuple[int, RequestState]]:
    """Interleave several streams as their items arrive, yielding ``(stream index, state)``.

    Closing the merged iterator closes (and so aborts) every stream that has not finished.
    """
    pending: dict[asyncio.Future[RequestState], int] = {}
    try:
        pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                try:
                    state = task.result()
                except StopAsyncIteration:
                    continue
                yield index, state
                pending[asyncio.ensure_future(anext(streams[index]))] = index
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def follow_streams(
    states: list[RequestState],
    streams: list[AsyncGenerator[RequestState, None]],
    chunks: Callable[[int, RequestState], list[str]],
) -> AsyncIterator[str]:
    """The events ``chunks(index, state)`` makes of each accepted request's state as it stands now
    (it may have moved on since acceptance), then of every later state as the streams deliver it.

    ``chunks`` decides what is new in a state (it keeps its own cursors) and returns its events."""
    for index, state in enumerate(states):
        for event in chunks(index, state):
            yield event
    async for index, state in merge_streams(streams):
        for event in chunks(index, state):
            yield event


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response that always closes its body iterator.

    Starlette stops iterating when the client disconnects but leaves the generator suspended; closing
    it here runs its cleanup (aborting the request in the engine) at once rather than at garbage
    collection.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncGenerator[str, None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._generator = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._generator.aclose()
