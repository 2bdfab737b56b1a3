"""``ZmqClient``: the ``EngineCoreClient`` (``core/client.py``) of an engine process, for asyncio.

It owns the engine process (``core/engine_proc.py``) and both ZMQ sockets. One receive task reads
every engine message and routes it: an ``AddResult`` or ``UtilityResult`` answers the call waiting
for it, ``StepOutputs`` queue up for ``get_outputs``, an ``EngineFault`` kills the client. A watcher
thread blocked in ``wait()`` on the process notices when it exits. Sends never block: the input
socket's queue is unbounded and every send is ``NOBLOCK``.

Start it in two halves so the caller can work while the engine loads the model::

    launch = EngineLaunch.begin(config)        # sockets bound, process started
    ...                                          # e.g. load the tokenizer meanwhile
    client = await launch.wait_ready(timeout)   # EngineReady came
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
import subprocess
import threading
import time
from contextlib import suppress
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tokenmill.config import EngineConfig
from tokenmill.core.client import EngineDeadError, UtilityCallError
from tokenmill.core.engine_proc import (
    EngineProcessHandle,
    make_socket_dir,
    socket_addresses,
    spawn_engine_process,
    stop_engine_process,
)
from tokenmill.protocol import (
    AbortRequests,
    AddRequests,
    AddResult,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineFault,
    EngineMessage,
    EngineReady,
    EngineStartFailed,
    FrontendMessage,
    ShutdownEngine,
    StepOutputs,
    UtilityCall,
    UtilityResult,
    UtilityValue,
)
from tokenmill.step_control import InterruptFlag

logger = logging.getLogger(__name__)

Sockets = tuple[zmq.Context, zmq.Socket, zmq.asyncio.Context, zmq.asyncio.Socket]


class EngineLaunch:
    """An engine process started and connected to, not yet ready; ``wait_ready`` or ``abandon`` it."""

    def __init__(self, handle: EngineProcessHandle, sockets: Sockets) -> None:
        self.handle = handle
        self.sockets = sockets

    @classmethod
    def begin(
        cls, config: EngineConfig, *, log_level: str = "INFO", spawned: EngineProcessHandle | None = None
    ) -> EngineLaunch:
        """Bind the output socket, connect the input socket and spawn the engine process for
        ``config`` (or take ``spawned``, one already started by ``spawn_engine_process`` in its own
        ``make_socket_dir()`` folder)."""
        socket_dir = spawned.socket_dir if spawned is not None else make_socket_dir()
        input_address, output_address = socket_addresses(socket_dir)
        async_context = zmq.asyncio.Context()
        output = async_context.socket(zmq.PULL)
        output.setsockopt(zmq.RCVHWM, 0)
        output.bind(output_address)
        sync_context = zmq.Context()
        input_socket = sync_context.socket(zmq.PUSH)
        # Unbounded queue: a send never blocks the event loop, even before the engine has bound.
        input_socket.setsockopt(zmq.SNDHWM, 0)
        input_socket.setsockopt(zmq.LINGER, 0)
        input_socket.connect(input_address)
        handle = spawned if spawned is not None else spawn_engine_process(config, socket_dir, log_level)
        return cls(handle, (sync_context, input_socket, async_context, output))

    async def wait_ready(self, timeout: float) -> ZmqClient:
        """The client, once the engine reports ``EngineReady``. Raises RuntimeError with the engine's
        own message if it fails to start, exits early or takes longer than ``timeout`` seconds (the
        caller then ``abandon``s the launch)."""
        output = self.sockets[3]
        process = self.handle.process
        decoder = msgspec.msgpack.Decoder(EngineMessage)
        deadline = time.monotonic() + timeout
        while True:
            if await output.poll(200):
                message = decoder.decode(await output.recv())
                if isinstance(message, EngineReady):
                    return ZmqClient(self.handle, self.sockets, message)
                if isinstance(message, EngineStartFailed):
                    raise RuntimeError(f"the engine failed to start: {message.error}")
                raise RuntimeError(f"unexpected first message from the engine: {type(message).__name__}")
            code = process.poll()
            if code is not None:
                raise RuntimeError(f"the engine process exited with code {code} before it was ready")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine was not ready after {timeout:.0f} s")

    def abandon(self) -> None:
        """Stop the process and release the sockets and their folder."""
        stop_engine_process(self.handle.process)
        _close_sockets(self.sockets, self.handle.socket_dir)


class ZmqClient:
    """``EngineCoreClient`` over ZMQ to an engine process; made by ``EngineLaunch.wait_ready`` inside
    the event loop it then serves. See ``core/client.py`` for the contract.

    Failure: when the process exits or reports a fault, every pending ``add_request_group`` and
    ``call_utility`` raises ``EngineDeadError`` at once, ``get_outputs`` raises it once the outputs
    already received are taken, and so does every later call.
    """

    def __init__(self, handle: EngineProcessHandle, sockets: Sockets, ready: EngineReady) -> None:
        self.info = ready
        self._handle = handle
        self._sockets = sockets
        self._input = sockets[1]
        self._output = sockets[3]
        # Raised after sending a group that may cut the step in flight short (step_control.py); None
        # when the engine made no flag.
        self._interrupt = InterruptFlag.attach(handle.socket_dir)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineMessage)
        # Pending answers: an add by its group's first request id, a utility call by its call id.
        self._adds: dict[str, asyncio.Future[AddResult]] = {}
        self._calls: dict[int, asyncio.Future[dict[str, UtilityValue]]] = {}
        self._call_ids = itertools.count()
        # Step outputs in arrival order; None wakes a reader after the engine is gone.
        self._outputs: asyncio.Queue[EngineCoreOutputs | None] = asyncio.Queue()
        self._dead_reason: str | None = None
        self._shutting_down = False
        self._closed = False
        self._loop = asyncio.get_running_loop()
        self._receive_task = asyncio.create_task(self._receive_loop(), name="tokenmill-engine-receive")
        threading.Thread(target=self._watch_process, name="tokenmill-engine-watch", daemon=True).start()

    # ------------------------------------------------------------------ EngineCoreClient

    @property
    def can_cut_steps(self) -> bool:
        return self._interrupt is not None

    @property
    def is_alive(self) -> bool:
        return self._dead_reason is None and self._handle.process.poll() is None

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    async def add_request_group(
        self, requests: list[EngineCoreRequest], *, cut_step: bool = False
    ) -> AddResult:
        if not requests:
            raise ValueError("a request group needs at least one request")
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        key = requests[0].request_id
        future: asyncio.Future[AddResult] = self._loop.create_future()
        self._adds[key] = future
        self._send(AddRequests(requests=requests))
        if cut_step and self._interrupt is not None:
            self._interrupt.raise_()  # after the send: the engine finds the group when it looks
        try:
            return await future
        finally:
            self._adds.pop(key, None)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send(AbortRequests(request_ids=request_ids))

    async def get_outputs(self) -> EngineCoreOutputs:
        if self._dead_reason is not None and self._outputs.empty():
            raise EngineDeadError(self._dead_reason)
        outputs = await self._outputs.get()
        if outputs is None:
            raise EngineDeadError(self._dead_reason or "the engine is gone")
        return outputs

    async def call_utility(
        self, method: str, args: dict[str, UtilityValue] | None = None
    ) -> dict[str, UtilityValue]:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        call_id = next(self._call_ids)
        future: asyncio.Future[dict[str, UtilityValue]] = self._loop.create_future()
        self._calls[call_id] = future
        self._send(UtilityCall(call_id=call_id, method=method, args=args or {}))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the engine to exit, terminate it if it lingers past ``timeout`` seconds, and release
        the sockets and their folder; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._shutting_down = True
        process = self._handle.process
        if process.poll() is None:
            self._send(ShutdownEngine())
            try:
                await asyncio.to_thread(process.wait, timeout)
            except subprocess.TimeoutExpired:
                logger.warning("the engine process did not stop in %.0f s; terminating it", timeout)
                await asyncio.to_thread(stop_engine_process, process)
        self._mark_dead("the server is shutting down")
        self._receive_task.cancel()
        with suppress(asyncio.CancelledError):
            await self._receive_task
        if self._interrupt is not None:
            self._interrupt.close()
        _close_sockets(self._sockets, self._handle.socket_dir)

    # ------------------------------------------------------------------ receiving

    async def _receive_loop(self) -> None:
        try:
            while True:
                frame = await self._output.recv(copy=False)
                self._route(self._decoder.decode(frame.buffer))
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug here would leave every caller waiting forever; fail loudly instead.
            logger.exception("output dispatch failed")
            self._mark_dead("the server lost its connection to the engine (output dispatch failed)")

    def _route(self, message: EngineMessage) -> None:
        if isinstance(message, StepOutputs):
            self._outputs.put_nowait(message.outputs)
        elif isinstance(message, AddResult):
            added = self._adds.pop(message.request_ids[0], None) if message.request_ids else None
            if added is not None and not added.done():  # else the caller went away before the answer
                added.set_result(message)
        elif isinstance(message, UtilityResult):
            called = self._calls.pop(message.call_id, None)
            if called is not None and not called.done():
                if message.error is not None:
                    called.set_exception(UtilityCallError(message.error))
                else:
                    called.set_result(dict(message.result))
        elif isinstance(message, EngineFault):
            logger.error("engine fault: %s", message.error)
            self._mark_dead(f"the engine failed: {message.error}")
        else:
            logger.warning("ignoring unexpected engine message %s", type(message).__name__)

    # ------------------------------------------------------------------ death

    def _watch_process(self) -> None:
        code = self._handle.process.wait()
        with suppress(RuntimeError):  # the loop is already closed: nobody is left to tell
            self._loop.call_soon_threadsafe(self._on_process_exit, code)

    def _on_process_exit(self, code: int) -> None:
        if not self._shutting_down:
            logger.error("the engine process %d exited with code %d", self.info.pid, code)
        self._mark_dead(f"the engine process exited (code {code})")

    def _mark_dead(self, reason: str) -> None:
        """Fail every pending answer at once and wake the outputs' reader; keeps the first reason."""
        if self._dead_reason is None:
            self._dead_reason = reason
            self._outputs.put_nowait(None)
        pending: list[asyncio.Future[Any]] = [*self._adds.values(), *self._calls.values()]
        for future in pending:
            if not future.done():
                future.set_exception(EngineDeadError(self._dead_reason))

    def _send(self, message: FrontendMessage) -> None:
        try:
            self._input.send(self._encoder.encode(message), zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            # Only possible when the socket is closed (shutdown); the engine is going away anyway.
            logger.warning("could not send %s to the engine: %s", type(message).__name__, exc)


def _close_sockets(sockets: Sockets, socket_dir: str) -> None:
    sync_context, input_socket, async_context, output = sockets
    input_socket.close(linger=0)
    output.close(linger=0)
    sync_context.term()
    async_context.term()
    shutil.rmtree(socket_dir, ignore_errors=True)
