"""``AsyncLLM``: the server's asyncio client of an engine core running in its own process.

It owns the engine process and both ZMQ sockets, tokenizes and checks prompts (``InputProcessor``),
and turns the engine's token ids back into text (``OutputProcessor``) in one output-dispatch task.
Callers iterate ``generate(...)``; every item is the request's live ``RequestState``, whose
``SampleState.sent_*`` fields let a streaming caller compute what is new since its last chunk.

Failure contract: if the engine process dies or reports a fault, every request in flight ends at
once with ``EngineFaultError`` and every later call raises ``EngineDeadError``; nothing waits on a
dead engine. Closing or cancelling a ``generate`` iterator before it finishes aborts the request in
the engine, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
import subprocess
import threading
import time
from collections.abc import AsyncGenerator
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import zmq
import zmq.asyncio
from transformers import PreTrainedTokenizerBase

from tokenmill.config import EngineConfig
from tokenmill.frontend.output_processor import OutputProcessor, RequestState
from tokenmill.frontend.processor import InputProcessor
from tokenmill.frontend.step_cuts import PrefixEstimate, StepCuts
from tokenmill.loader import ModelSource, resolve_model
from tokenmill.protocol import (
    AbortRequests,
    AddRequests,
    AddResult,
    EngineCoreOutputs,
    EngineFault,
    EngineMessage,
    EngineReady,
    EngineStartFailed,
    FrontendMessage,
    ShutdownEngine,
    StepOutputs,
    UtilityCall,
    UtilityResult,
)
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.engine_process import (
    EngineProcessHandle,
    make_socket_dir,
    socket_addresses,
    spawn_engine_process,
    stop_engine_process,
)
from tokenmill.step_control import InterruptFlag

logger = logging.getLogger(__name__)
request_logger = logging.getLogger("tokenmill.requests")


class EngineDeadError(RuntimeError):
    """The engine process is gone (or shutting down): no request can be served any more."""


class EngineFaultError(RuntimeError):
    """The engine failed or died while this request was in flight."""


class RequestRejectedError(ValueError):
    """The engine refused the request: it can never run, or (``overloaded``) the queue is full."""

    def __init__(self, message: str, overloaded: bool = False, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.overloaded = overloaded
        self.retry_after = retry_after


@dataclass
class EngineStats:
    """Gauges from the engine's latest step and counters the frontend keeps (read by /metrics)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generation_tokens: int = 0
    jump_forward_tokens: int = 0
    finished_requests: dict[str, int] = field(default_factory=dict)
    num_running_by_tier: dict[str, int] = field(default_factory=dict)
    num_waiting_by_tier: dict[str, int] = field(default_factory=dict)
    # Requests refused because a waiting queue was full (HTTP 429), by service tier.
    overloaded_by_tier: dict[str, int] = field(default_factory=dict)


@dataclass
class FinishedRequestStats:
    """One accepted request's numbers, reported once when it ends (finished, aborted or failed)."""

    request_id: str
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generation_tokens: int
    time_to_first_token: float | None
    e2e_latency: float
    service_tier: str = "default"


class StatsListener(Protocol):
    """Receives latency observations as they happen (the server's Prometheus metrics implement it)."""

    def on_first_token(self, seconds: float, service_tier: str) -> None: ...

    def on_inter_token(self, seconds: float, service_tier: str) -> None: ...

    def on_request_finished(self, stats: FinishedRequestStats) -> None: ...


@dataclass
class _Stream:
    """The dispatch task's handle on one live ``generate`` call."""

    state: RequestState
    core_ids: list[str]
    accepted: asyncio.Future[None]
    changed: asyncio.Event
    arrival: float  # time.monotonic()
    service_tier: str = "default"
    cache_salt: str | None = None
    error: BaseException | None = None
    rejected: bool = False
    first_token: float | None = None
    last_token: dict[str, float] = field(default_factory=dict)


class AsyncLLM:
    """Serve one model from an engine-core process; create with ``await AsyncLLM.start(config)``.

    Contract: ``generate`` raises ``ValueError`` for a prompt that does not fit the context window,
    ``RequestRejectedError`` when the engine refuses it, ``EngineDeadError`` when the engine is gone
    and ``EngineFaultError`` when it fails mid-request. ``shutdown`` stops the engine process and
    waits for it, so no process outlives the server.
    """

    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        tokenizer: PreTrainedTokenizerBase,
        handle: EngineProcessHandle,
        sockets: tuple[zmq.Context, zmq.Socket, zmq.asyncio.Context, zmq.asyncio.Socket],
        ready: EngineReady,
        log_requests: bool,
    ) -> None:
        self.config = config
        self.source = source
        self.tokenizer = tokenizer
        self.max_model_len = ready.max_model_len
        self.num_blocks = ready.num_blocks
        self.engine_pid = ready.pid
        self.log_requests = log_requests
        self.input_processor = InputProcessor(tokenizer, source.hf_config, ready.max_model_len)
        self.output_processor = OutputProcessor(tokenizer)
        self.stats = EngineStats()
        self.listeners: list[StatsListener] = []
        self._handle = handle
        self._sync_context, self._input, self._async_context, self._output = sockets
        # Raised after sending a request of a tier with a TTFT target, or one whose prompt needs a short
        # prefill: the engine may cut the step in flight short for it (step_control.py). None when
        # the engine made no flag.
        self._interrupt = InterruptFlag.attach(handle.socket_dir)
        short_prefill = config.scheduler.short_prefill_interrupt
        estimate = (
            PrefixEstimate(ready.block_size, ready.num_blocks)
            if short_prefill > 0 and config.cache.enable_prefix_caching
            else None
        )
        self._step_cuts = StepCuts(config.scheduler.ttft_target_tiers(), short_prefill, estimate)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineMessage)
        self._streams: dict[str, _Stream] = {}
        self._by_core_id: dict[str, _Stream] = {}
        self._calls: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._call_ids = itertools.count()
        self._dead_reason: str | None = None
        self._shutting_down = False
        self._closed = False
        self._loop = asyncio.get_running_loop()
        self._dispatch_task = asyncio.create_task(self._dispatch_loop(), name="tokenmill-output-dispatch")
        threading.Thread(target=self._watch_process, name="tokenmill-engine-watch", daemon=True).start()

    # ------------------------------------------------------------------ start-up

    @classmethod
    async def start(
        cls,
        config: EngineConfig,
        source: ModelSource | None = None,
        *,
        log_requests: bool = False,
        log_level: str = "INFO",
        start_timeout: float = 600.0,
        spawned: EngineProcessHandle | None = None,
    ) -> AsyncLLM:
        """Spawn the engine process (or take ``spawned``, one already started for ``config`` by
        ``spawn_engine_process`` in its own ``make_socket_dir()`` folder) and wait until it has loaded
        the model; meanwhile resolve ``source`` (when None) and load the tokenizer.

        Raises RuntimeError with the engine's own message if it fails to start, exits early or
        takes longer than ``start_timeout`` seconds; the process is cleaned up in every case.
        """
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
        sockets = (sync_context, input_socket, async_context, output)
        try:
            # The engine loads the model meanwhile: resolving the model (its config) and loading the
            # tokenizer here overlap with it.
            source = source or resolve_model(config.model.model)
            tokenizer = source.load_tokenizer()
            ready = await _wait_ready(output, handle.process, start_timeout)
        except BaseException:
            stop_engine_process(handle.process)
            _close_sockets(sockets, socket_dir)
            raise
        logger.info(
            "engine process %d ready: max_model_len=%d, %d KV blocks of %d tokens",
            ready.pid,
            ready.max_model_len,
            ready.num_blocks,
            ready.block_size,
        )
        return cls(config, source, tokenizer, handle, sockets, ready, log_requests)

    # ------------------------------------------------------------------ requests

    @property
    def is_alive(self) -> bool:
        """True while the engine process runs and has not reported a fault."""
        return self._dead_reason is None and self._handle.process.poll() is None

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        service_tier: str = "default",
        user: str | None = None,
        timeout: float | None = None,
    ) -> AsyncGenerator[RequestState, None]:
        """Run one request; yields its ``RequestState`` once accepted and then after every change.

        The first item arrives when the engine has accepted the request (so callers can still answer
        with an HTTP error before streaming); the last item is the finished state. The same object is
        yielded each time: read what you need before awaiting anything else. ``service_tier`` must be
        a configured tier (resolve ``auto`` first); ``timeout`` seconds after arrival the engine ends
        the request with finish reason ``timeout``.
        """
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        core_requests = self.input_processor.make_requests(
            request_id,
            prompt_token_ids,
            params,
            priority=priority,
            cache_salt=cache_salt,
            service_tier=service_tier,
            user=user,
            timeout=timeout,
        )
        state = self.output_processor.add_request(request_id, prompt, prompt_token_ids, params)
        stream = _Stream(
            state=state,
            core_ids=[r.request_id for r in core_requests],
            accepted=self._loop.create_future(),
            changed=asyncio.Event(),
            arrival=time.monotonic(),
            service_tier=service_tier,
            cache_salt=cache_salt,
        )
        self._streams[request_id] = stream
        for core_id in stream.core_ids:
            self._by_core_id[core_id] = stream
        if self.log_requests:
            request_logger.info("request %s received: prompt=%r params=%s", request_id, prompt, params)
        self._send(AddRequests(requests=core_requests))
        if self._interrupt is not None and self._step_cuts.on_send(
            service_tier, prompt_token_ids, cache_salt
        ):
            self._interrupt.raise_()
        try:
            await stream.accepted
            while True:
                stream.changed.clear()
                seen_finished = state.finished
                yield state
                if seen_finished:
                    return
                await stream.changed.wait()
                if stream.error is not None:
                    raise stream.error
        finally:
            self._release(stream)

    def abort(self, request_id: str) -> None:
        """End a request early (its iterator yields the state with reason ``abort``); unknown ids are ignored."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        core_ids = self.output_processor.abort(request_id)
        if core_ids:
            self._send(AbortRequests(request_ids=core_ids))
        stream.changed.set()

    def _release(self, stream: _Stream) -> None:
        """Forget a stream; abort it in the engine unless it finished there or never got in."""
        state = stream.state
        self._streams.pop(state.request_id, None)
        for core_id in stream.core_ids:
            self._by_core_id.pop(core_id, None)
        if not state.finished:
            core_ids = self.output_processor.abort(state.request_id)
            if core_ids and not stream.rejected and self._dead_reason is None:
                self._send(AbortRequests(request_ids=core_ids))
        if stream.rejected:
            return
        if state.finished:
            answers = [sample.token_ids for sample in state.samples]
            self._step_cuts.on_finish(stream.cache_salt, state.prompt_token_ids, answers)
        self._record_finished(stream)

    def _record_finished(self, stream: _Stream) -> None:
        state = stream.state
        reasons = sorted({s.finish_reason or "abort" for s in state.samples})
        reason = "error" if stream.error is not None else ",".join(reasons)
        now = time.monotonic()
        ttft = None if stream.first_token is None else stream.first_token - stream.arrival
        stats = FinishedRequestStats(
            request_id=state.request_id,
            finish_reason=reason,
            num_prompt_tokens=len(state.prompt_token_ids),
            num_cached_tokens=state.num_cached_tokens,
            num_generation_tokens=sum(len(s.token_ids) for s in state.samples),
            time_to_first_token=ttft,
            e2e_latency=now - stream.arrival,
            service_tier=stream.service_tier,
        )
        self.stats.finished_requests[reason] = self.stats.finished_requests.get(reason, 0) + 1
        for listener in self.listeners:
            listener.on_request_finished(stats)
        line = (
            f"request {stats.request_id} finished ({reason}): prompt_tokens={stats.num_prompt_tokens} "
            f"cached_tokens={stats.num_cached_tokens} output_tokens={stats.num_generation_tokens} "
            f"ttft={'-' if ttft is None else f'{ttft:.3f}s'} e2e={stats.e2e_latency:.3f}s "
            f"tier={stats.service_tier}"
        )
        if self.log_requests:
            line += f" output={[s.text for s in state.samples]!r}"
        request_logger.info(line)

    # ------------------------------------------------------------------ utility calls

    async def call_utility(self, method: str, timeout: float = 30.0) -> dict[str, Any]:
        """Run an engine method by name between steps and return its result dict."""
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        call_id = next(self._call_ids)
        future: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self._calls[call_id] = future
        self._send(UtilityCall(call_id=call_id, method=method))
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._calls.pop(call_id, None)

    async def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache; False while running requests still hold cached blocks."""
        success = bool((await self.call_utility("reset_prefix_cache"))["success"])
        if success:
            self._step_cuts.on_cache_reset()
        return success

    async def kv_stats(self) -> dict[str, Any]:
        """Live KV-cache numbers from the engine: free / cached / in-use blocks, queue lengths."""
        return await self.call_utility("kv_stats")

    # ------------------------------------------------------------------ the output-dispatch task

    async def _dispatch_loop(self) -> None:
        try:
            while True:
                frame = await self._output.recv(copy=False)
                message = self._decoder.decode(frame.buffer)
                self._handle_message(message)
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug here would leave every request waiting forever; fail loudly instead.
            logger.exception("output dispatch failed")
            self._mark_dead("the server lost its connection to the engine (output dispatch failed)")

    def _handle_message(self, message: EngineMessage) -> None:
        if isinstance(message, StepOutputs):
            self._on_outputs(message.outputs)
        elif isinstance(message, AddResult):
            self._on_add_result(message)
        elif isinstance(message, UtilityResult):
            future = self._calls.pop(message.call_id, None)
            if future is not None and not future.done():
                if message.error is not None:
                    future.set_exception(RuntimeError(message.error))
                else:
                    future.set_result(dict(message.result))
        elif isinstance(message, EngineFault):
            logger.error("engine fault: %s", message.error)
            self._mark_dead(f"the engine failed: {message.error}")
        else:
            logger.warning("ignoring unexpected engine message %s", type(message).__name__)

    def _on_add_result(self, result: AddResult) -> None:
        stream = self._by_core_id.get(result.request_ids[0]) if result.request_ids else None
        if stream is None or stream.accepted.done():
            return  # the caller went away before the answer came
        if result.error is not None:
            stream.rejected = True
            if result.overloaded:
                tier = stream.service_tier
                self.stats.overloaded_by_tier[tier] = self.stats.overloaded_by_tier.get(tier, 0) + 1
            stream.accepted.set_exception(
                RequestRejectedError(result.error, result.overloaded, result.retry_after)
            )
            return
        self.stats.prompt_tokens += len(stream.state.prompt_token_ids)
        stream.accepted.set_result(None)

    def _on_outputs(self, batch: EngineCoreOutputs) -> None:
        self.stats.num_running = batch.num_running
        self.stats.num_waiting = batch.num_waiting
        self.stats.kv_cache_usage = batch.kv_cache_usage
        self.stats.num_preemptions += batch.num_preemptions
        self.stats.jump_forward_tokens += batch.num_forced_tokens
        self.stats.prefix_cache_queried_tokens = batch.prefix_cache_queried_tokens
        self.stats.prefix_cache_hit_tokens = batch.prefix_cache_hit_tokens
        self.stats.num_running_by_tier = batch.num_running_by_tier
        self.stats.num_waiting_by_tier = batch.num_waiting_by_tier
        if not batch.outputs:
            return
        now = time.monotonic()
        touched: dict[str, _Stream] = {}
        for output in batch.outputs:
            stream = self._by_core_id.get(output.request_id)
            if stream is None:
                continue
            touched[stream.state.request_id] = stream
            if output.error is not None:
                stream.error = EngineFaultError(f"the engine failed on this request: {output.error}")
            self._observe_tokens(stream, output.request_id, len(output.new_token_ids), now)
        already_cached = {rid: s.state.num_cached_tokens for rid, s in touched.items()}
        _, to_abort = self.output_processor.process(batch.outputs)
        if to_abort:  # stop strings matched on this side; the engine must stop those samples
            self._send(AbortRequests(request_ids=to_abort))
        for request_id, stream in touched.items():
            self.stats.cached_prompt_tokens += stream.state.num_cached_tokens - already_cached[request_id]
            stream.changed.set()

    def _observe_tokens(self, stream: _Stream, core_id: str, num_tokens: int, now: float) -> None:
        if num_tokens == 0:
            return
        self.stats.generation_tokens += num_tokens
        if stream.first_token is None:
            stream.first_token = now
            for listener in self.listeners:
                listener.on_first_token(now - stream.arrival, stream.service_tier)
        previous = stream.last_token.get(core_id)
        if previous is not None:
            for listener in self.listeners:
                listener.on_inter_token((now - previous) / num_tokens, stream.service_tier)
        stream.last_token[core_id] = now

    # ------------------------------------------------------------------ engine death and shutdown

    def _watch_process(self) -> None:
        code = self._handle.process.wait()
        with suppress(RuntimeError):  # the loop is already closed: nobody is left to tell
            self._loop.call_soon_threadsafe(self._on_process_exit, code)

    def _on_process_exit(self, code: int) -> None:
        if not self._shutting_down:
            logger.error("the engine process %d exited with code %d", self.engine_pid, code)
        self._mark_dead(f"the engine process exited (code {code})")

    def _mark_dead(self, reason: str) -> None:
        """Fail every waiting caller at once; later calls raise ``EngineDeadError``."""
        if self._dead_reason is None:
            self._dead_reason = reason
        message = f"{reason} while this request was in flight"
        for stream in list(self._streams.values()):
            if not stream.accepted.done():
                stream.accepted.set_exception(EngineFaultError(message))
            elif stream.error is None and not stream.state.finished:
                stream.error = EngineFaultError(message)
            stream.changed.set()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))

    def _send(self, message: FrontendMessage) -> None:
        try:
            self._input.send(self._encoder.encode(message), zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            # Only possible when the socket is closed (shutdown); the engine is going away anyway.
            logger.warning("could not send %s to the engine: %s", type(message).__name__, exc)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process (politely, then by force) and release sockets; idempotent."""
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
        self._dispatch_task.cancel()
        with suppress(asyncio.CancelledError):
            await self._dispatch_task
        if self._interrupt is not None:
            self._interrupt.close()
        _close_sockets(
            (self._sync_context, self._input, self._async_context, self._output), self._handle.socket_dir
        )


async def _wait_ready(
    output: zmq.asyncio.Socket, process: subprocess.Popen[bytes], timeout: float
) -> EngineReady:
    decoder = msgspec.msgpack.Decoder(EngineMessage)
    deadline = time.monotonic() + timeout
    while True:
        if await output.poll(200):
            message = decoder.decode(await output.recv())
            if isinstance(message, EngineReady):
                return message
            if isinstance(message, EngineStartFailed):
                raise RuntimeError(f"the engine failed to start: {message.error}")
            raise RuntimeError(f"unexpected first message from the engine: {type(message).__name__}")
        code = process.poll()
        if code is not None:
            raise RuntimeError(f"the engine process exited with code {code} before it was ready")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine was not ready after {timeout:.0f} s")


def _close_sockets(
    sockets: tuple[zmq.Context, zmq.Socket, zmq.asyncio.Context, zmq.asyncio.Socket], socket_dir: str
) -> None:
    sync_context, input_socket, async_context, output = sockets
    input_socket.close(linger=0)
    output.close(linger=0)
    sync_context.term()
    async_context.term()
    shutil.rmtree(socket_dir, ignore_errors=True)
