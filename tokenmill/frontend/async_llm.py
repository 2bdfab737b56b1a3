"""``AsyncLLM``: the server's asyncio frontend of an engine core running in its own process.

It talks to the engine through a ``ZmqClient`` (``core/zmq_client.py``, which owns the engine
process and its sockets), tokenizes and checks prompts (``InputProcessor``), and turns the engine's
token ids back into text (``OutputProcessor``) in one output-dispatch task.
Callers iterate ``generate(...)``; every item is the request's live ``RequestState``, whose
``SampleState.sent_*`` fields let a streaming caller compute what is new since its last chunk.

Failure contract: if the engine process dies or reports a fault, every request in flight ends at
once with ``EngineGoneError`` (an ``EngineFaultError``; a fault the engine reports on one request
fails only that one, with ``EngineFaultError``), every later call raises ``EngineDeadError`` and
``engine_died`` is set; nothing waits on a dead engine. Closing or cancelling a ``generate``
iterator before it finishes aborts the request in the engine, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from tokenmill.config import EngineConfig
from tokenmill.core.client import EngineCoreClient, EngineDeadError
from tokenmill.core.dp_client import DPClient, DPLaunch, ReplicaStats
from tokenmill.core.engine_proc import EngineProcessHandle
from tokenmill.core.zmq_client import EngineLaunch
from tokenmill.frontend.output_processor import OutputProcessor, RequestState
from tokenmill.frontend.processor import InputProcessor
from tokenmill.frontend.step_cuts import PrefixEstimate, StepCuts
from tokenmill.loader import ModelSource, resolve_model
from tokenmill.protocol import EngineCoreOutputs, UtilityValue
from tokenmill.sampling_params import SamplingParams

__all__ = [
    "AsyncLLM",
    "EngineDeadError",
    "EngineFaultError",
    "EngineGoneError",
    "EngineMemoryReleasedError",
    "RequestRejectedError",
]

logger = logging.getLogger(__name__)
request_logger = logging.getLogger("tokenmill.requests")


class EngineFaultError(RuntimeError):
    """The engine failed or died while this request was in flight."""


class EngineMemoryReleasedError(EngineDeadError):
    """The engine's memory is released for a trainer (``release_memory_occupation``): no request is
    served until ``resume_memory_occupation`` (HTTP 503, as for an engine that is not available)."""


class EngineGoneError(EngineFaultError):
    """The engine process died (or the server lost it) while this request was in flight; unlike a
    fault on one request, nothing will serve it again (the server answers 503)."""


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
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
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
        client: EngineCoreClient,
        log_requests: bool,
    ) -> None:
        ready = client.info
        self.config = config
        self.source = source
        self.tokenizer = tokenizer
        self.max_model_len = ready.max_model_len
        self.num_blocks = ready.num_blocks
        self.block_size = ready.block_size

        self.kv_cache_bytes = ready.kv_cache_bytes  # the KV pool: num_blocks × block_size tokens
        self.engine_pid = ready.pid
        # Every engine process: one, or one per data-parallel replica.
        self.engine_pids = client.pids if isinstance(client, DPClient) else [ready.pid]
        self.log_requests = log_requests
        self.input_processor = InputProcessor(tokenizer, source.hf_config, ready.max_model_len)
        self.output_processor = OutputProcessor(tokenizer)
        self.stats = EngineStats()
        self.listeners: list[StatsListener] = []
        self._client = client
        # Which arrivals may cut the step in flight short (a tier with a TTFT target, a short
        # prefill): step_control.py.
        short_prefill = config.scheduler.short_prefill_interrupt
        estimate = (
            PrefixEstimate(ready.block_size, ready.num_blocks)
            if short_prefill > 0 and config.cache.enable_prefix_caching
            else None
        )
        self._step_cuts = StepCuts(config.scheduler.ttft_target_tiers(), short_prefill, estimate)
        self._streams: dict[str, _Stream] = {}
        self._by_core_id: dict[str, _Stream] = {}
        self._closed = False
        # Why this frontend failed its requests, when it did so on its own (its dispatch broke).
        self._failed_reason: str | None = None
        # What release_memory_occupation freed and resume_memory_occupation has not brought back.
        self.memory_released = ""
        self._weight_version = "default"

        # Set once the engine process is gone for good (not by ``shutdown``): the server exits then.
        self.engine_died = asyncio.Event()
        self._dispatch_task = asyncio.create_task(self._dispatch_loop(), name="tokenmill-output-dispatch")

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
        spawned: EngineProcessHandle | Sequence[EngineProcessHandle] | None = None,
    ) -> AsyncLLM:
        """Spawn the engine process (or take ``spawned``, one already started for ``config`` by
        ``spawn_engine_process`` in its own ``make_socket_dir()`` folder) and wait until it has loaded
        the model; meanwhile resolve ``source`` (when None) and load the tokenizer. With
        ``data_parallel_size`` N > 1 it runs N engine processes behind a ``DPClient``
        (``spawned``: the N handles ``spawn_engines`` started).

        Raises RuntimeError with the engine's own message if it fails to start, exits early or
        takes longer than ``start_timeout`` seconds; the process is cleaned up in every case.
        """
        handles = [spawned] if isinstance(spawned, EngineProcessHandle) else spawned
        launch: EngineLaunch | DPLaunch
        if config.data_parallel.data_parallel_size > 1:
            launch = DPLaunch.begin(config, log_level=log_level, spawned=handles)
        else:
            launch = EngineLaunch.begin(config, log_level=log_level, spawned=handles[0] if handles else None)
        try:
            # The engine loads the model meanwhile: resolving the model (its config) and loading the
            # tokenizer here overlap with it.
            source = source or resolve_model(config.model.model)
            tokenizer = source.load_tokenizer()
            client = await launch.wait_ready(start_timeout)
        except BaseException:
            launch.abandon()
            raise
        ready = client.info
        logger.info(
            "engine process %d ready: max_model_len=%d, KV cache of %d tokens (%d blocks of %d), %.2f GB",
            ready.pid,
            ready.max_model_len,
            ready.num_blocks * ready.block_size,
            ready.num_blocks,
            ready.block_size,
            ready.kv_cache_bytes / 1e9,
        )
        return cls(config, source, tokenizer, client, log_requests)

    # ------------------------------------------------------------------ requests

    @property
    def is_alive(self) -> bool:
        """True while the engine process runs and has not reported a fault."""
        return self._failed_reason is None and self._client.is_alive

    @property
    def dead_reason(self) -> str | None:
        return self._client.dead_reason or self._failed_reason

    @property
    def weight_version(self) -> str:
        """The version of the weights the engine serves (``"default"`` until weights are updated):
        the latest of an update's answer and the version the engine's last tokens carried."""
        return self._weight_version

    @property
    def replica_stats(self) -> list[ReplicaStats]:
        """Each data-parallel engine's numbers (``DPClient.replica_stats``); empty with one engine."""
        return self._client.replica_stats() if isinstance(self._client, DPClient) else []

    @property
    def request_ids(self) -> list[str]:
        """The ids of the ``generate`` calls in flight (accepted or waiting for acceptance)."""
        return list(self._streams)

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
        lora_name: str | None = None,
    ) -> AsyncGenerator[RequestState, None]:
        """Run one request; yields its ``RequestState`` once accepted and then after every change.

        The first item arrives when the engine has accepted the request (so callers can still answer
        with an HTTP error before streaming); the last item is the finished state. The same object is
        yielded each time: read what you need before awaiting anything else. ``service_tier`` must be
        a configured tier (resolve ``auto`` first); ``timeout`` seconds after arrival the engine ends
        the request with finish reason ``timeout``. ``lora_name`` names a loaded LoRA adapter (None:
        the base model).
        """
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self.memory_released:
            raise EngineMemoryReleasedError(
                f"its memory ({self.memory_released}) is released for training; resume_memory_occupation first"
            )
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
        for core_request in core_requests:
            core_request.lora_name = lora_name
        state = self.output_processor.add_request(request_id, prompt, prompt_token_ids, params)
        stream = _Stream(
            state=state,
            core_ids=[r.request_id for r in core_requests],
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
        cut_step = self._client.can_cut_steps and self._step_cuts.on_send(
            service_tier, prompt_token_ids, cache_salt
        )
        try:
            try:
                added = await self._client.add_request_group(core_requests, cut_step=cut_step)
            except EngineDeadError as exc:
                raise EngineGoneError(f"{exc} while this request was in flight") from None
            if added.error is not None:
                stream.rejected = True
                if added.overloaded:
                    self.stats.overloaded_by_tier[service_tier] = (
                        self.stats.overloaded_by_tier.get(service_tier, 0) + 1
                    )
                raise RequestRejectedError(added.error, added.overloaded, added.retry_after)
            self.stats.prompt_tokens += len(prompt_token_ids)
            while True:
                stream.changed.clear()
                seen_finished = state.finished
                yield state
                if seen_finished:
                    return
                if stream.error is None:  # else it came before the clear: do not wait for another
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
            self._client.abort_requests(core_ids)
        stream.changed.set()

    def _release(self, stream: _Stream) -> None:
        """Forget a stream; abort it in the engine unless it finished there or never got in."""
        state = stream.state
        self._streams.pop(state.request_id, None)
        for core_id in stream.core_ids:
            self._by_core_id.pop(core_id, None)
        if not state.finished:
            core_ids = self.output_processor.abort(state.request_id)
            if core_ids and not stream.rejected and self.dead_reason is None:
                self._client.abort_requests(core_ids)
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

    async def call_utility(
        self, method: str, args: dict[str, UtilityValue] | None = None, timeout: float = 30.0
    ) -> dict[str, Any]:
        """Run an engine method by name between steps and return its result dict
        (``EngineCoreClient.call_utility``; ``UtilityCallError`` when it fails)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        result = await asyncio.wait_for(self._client.call_utility(method, args), timeout)
        if method in ("release_memory_occupation", "resume_memory_occupation"):
            self.memory_released = str(result.get("released") or "")
        version = result.get("weight_version")
        if isinstance(version, str):
            self._weight_version = version
        return result

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
                self._on_outputs(await self._client.get_outputs())
        except EngineDeadError as exc:
            self._fail_streams(str(exc))
            if not self._closed:
                self.engine_died.set()
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug here would leave every request waiting forever; fail loudly instead.
            logger.exception("output dispatch failed")
            self._fail_streams("the server lost its connection to the engine (output dispatch failed)")
            if not self._closed:
                self.engine_died.set()

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
        self.stats.spec_num_draft_tokens = batch.spec_num_draft_tokens
        self.stats.spec_num_accepted_tokens = batch.spec_num_accepted_tokens
        self.stats.spec_accepted_per_position = batch.spec_accepted_per_position
        if not batch.outputs:
            return
        now = time.monotonic()
        touched: dict[str, _Stream] = {}
        for output in batch.outputs:
            stream = self._by_core_id.get(output.request_id)
            if stream is None:
                continue
            touched[stream.state.request_id] = stream
            if output.weight_version is not None:
                self._weight_version = output.weight_version
            if output.error is not None:
                stream.error = EngineFaultError(f"the engine failed on this request: {output.error}")
            self._observe_tokens(stream, output.request_id, len(output.new_token_ids), now)
        already_cached = {rid: s.state.num_cached_tokens for rid, s in touched.items()}
        _, to_abort = self.output_processor.process(batch.outputs)
        if to_abort:  # stop strings matched on this side; the engine must stop those samples
            self._client.abort_requests(to_abort)
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

    def _fail_streams(self, reason: str) -> None:
        """Fail every request in flight at once (the client fails the calls still waiting for an
        answer; later calls raise ``EngineDeadError``)."""
        if self._failed_reason is None:
            self._failed_reason = reason
        message = f"{reason} while this request was in flight"
        for stream in list(self._streams.values()):
            if stream.error is None and not stream.state.finished:
                stream.error = EngineGoneError(message)
            stream.changed.set()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process (politely, then by force) and release sockets; idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._client.shutdown(timeout)
        self._fail_streams(self._client.dead_reason or "the server is shutting down")
        self._dispatch_task.cancel()
        with suppress(asyncio.CancelledError):
            await self._dispatch_task
