"""The engine core: one loop of schedule → execute → update over token ids.

It never sees text or HTTP. The offline ``LLM`` calls it in-process; the server runs it in its own
process behind a ZMQ socket. Every message in and out is a ``tokenmill.protocol`` struct.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import msgspec

from tokenmill.config import EngineConfig
from tokenmill.core.first_token_pass import split_first_tokens
from tokenmill.core.kv.hybrid import make_kv_manager
from tokenmill.core.kv.kv_events import attach_kv_events
from tokenmill.core.lora_engine import EngineLoRA
from tokenmill.core.pause import PauseControl
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.step_io import ModelRunnerOutput, SchedulerOutput, StepStatus
from tokenmill.core.weights import EngineWeights, UtilityHandler
from tokenmill.executor.factory import make_executor
from tokenmill.loader import ModelSource
from tokenmill.protocol import (
    RESERVED_UTILITY_METHODS,
    UTILITY_METHODS,
    AddResult,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    KVEvent,
    UtilityValue,
)
from tokenmill.sampling_params import SamplingParams
from tokenmill.step_control import InterruptFlag
from tokenmill.structured.backend import GrammarBackend
from tokenmill.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# Prompt lengths of the warm-up requests (``EngineCore.warm_up``), one arriving per step: uneven, so
# the steps' token and sequence counts vary apart and the step-time model can tell their costs apart.
WARM_UP_PROMPT_LENGTHS = (24, 160, 8, 320, 64, 40)
WARM_UP_OUTPUT_TOKENS = 4
# How often one step may pause for arrivals with short prefills: each pause delays its requests by
# one short pass, and the bound keeps them moving under a stream of arrivals.
MAX_PAUSES_PER_STEP = 3
# Arrivals' passes run one after another while a step is paused, before it goes on (the arrivals'
# pass admits as many as keep their mean time to first token least: ``Scheduler.schedule_beside``).
MAX_ARRIVAL_PASSES_PER_PAUSE = 4


def _expect_done(result: ModelRunnerOutput, what: str) -> None:
    """A plan that is neither pausable nor interruptible (an arrivals' pass, a step resumed for the
    last time) runs to the end: any other status is an executor's broken contract."""
    if result.status is not StepStatus.DONE:
        raise RuntimeError(f"{what} came back {result.status.value}; it may not be stopped")


def effective_max_model_len(config: EngineConfig, source: ModelSource, capacity_tokens: int) -> int:
    """The context window: the configured or model limit, capped by what the KV pool can hold."""
    model_limit = int(getattr(source.hf_config, "max_position_embeddings", 0) or 0) or 2048
    wanted = config.model.max_model_len or model_limit
    if config.model.max_model_len and config.model.max_model_len > model_limit:
        raise ValueError(
            f"max_model_len {config.model.max_model_len} exceeds the model's limit of {model_limit} positions"
        )
    if wanted > capacity_tokens:
        logger.warning(
            "context window lowered from %d to %d tokens: that is all the KV cache holds "
            "(give it more with kv_cache_memory)",
            wanted,
            capacity_tokens,
        )
        wanted = capacity_tokens
    return wanted


@dataclass
class PausedStep:
    """A planned step the executor paused between layers (and keeps: ``Executor.resume``): its plan,
    the share of its layers it has run, the seconds it has run, how often it paused, and how many
    arrivals' passes ran since the last pause."""

    plan: SchedulerOutput
    layers_done: float
    ran_seconds: float
    num_pauses: int = 1
    arrival_passes: int = 0


class EngineCore:
    """Owns the scheduler, the KV cache manager and the executor.

    Contract: ``add_request`` raises ValueError for a request that can never run and leaves the
    engine unchanged; ``step`` advances every scheduled request by one step and returns their
    outputs; ``abort_requests`` frees blocks at once.
    """

    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        config.validate()
        self.config = config
        self.source = source
        self.executor = make_executor(config, source)
        self.kv_manager = make_kv_manager(config, self.executor)  # with a state pool for hybrid models
        self.max_model_len = effective_max_model_len(config, source, self.kv_manager.capacity_tokens)
        self.scheduler = Scheduler(
            config.scheduler, self.kv_manager, self.max_model_len, speculative=config.speculative_config
        )
        # LoRA adapters and device slots (core/lora_engine.py), when enabled.
        self.lora = (
            EngineLoRA(config.lora, self.executor, self.scheduler) if config.lora.enable_lora else None
        )
        self._timed_a_step = False
        # The rest of a step whose first pass ran the prompts it finishes (core/first_token_pass.py).
        self._second_pass: SchedulerOutput | None = None
        self._arrival_passes_before_second = 0  # arrivals' passes run while it waited to start
        self.num_split_steps = 0  # steps run as a first-token pass and a second pass
        self.num_interrupted_steps = 0  # steps abandoned for a latency-critical arrival
        # A step paused between layers for arrivals' short prefills, and the aborts of its requests
        # that wait for it to end (step_control.py).
        self._paused: PausedStep | None = None
        self._aborted_while_paused: list[str] = []
        self.num_paused_steps = 0  # pauses, counting each of a step that paused more than once
        self.num_replanned_steps = 0  # paused steps put back for better-ranked waiting requests
        self.structured = StructuredOutputManager(
            self._make_grammar_backend, jump_forward=config.jump_forward
        )
        # RL: weight updates in place and their version (core/weights.py), pause and memory
        # release (core/pause.py); outputs those calls produced, sent with the next step's.
        self.pause = PauseControl(self)
        self.weights = EngineWeights(self.executor, self.kv_manager, self.settle_step, self.pause.abort_all)
        self._queued_outputs: list[EngineCoreOutput] = []
        self._utilities: dict[str, UtilityHandler] = {
            "reset_prefix_cache": lambda args: {"success": self.reset_prefix_cache()},
            "kv_stats": lambda args: self.kv_stats(),
            **self.weights.handlers(),
            **self.pause.handlers(),
            "load_lora": lambda args: self._lora_utility("load_lora", args),
            "unload_lora": lambda args: self._lora_utility("unload_lora", args),
        }
        # The prefix cache's changes, for a data-parallel frontend's index (core/kv/kv_events.py).
        self.kv_events = attach_kv_events(self) if config.data_parallel.publish_kv_events else None
        logger.info(
            "engine ready: max_model_len=%d, %d KV tokens, prefix caching %s",
            self.max_model_len,
            self.kv_manager.capacity_tokens,
            "on" if config.cache.enable_prefix_caching else "off",
        )

    def warm_up(self) -> float:
        """Run a few synthetic greedy requests before serving; returns the seconds they took.

        They pay the one-time costs (lazy initialization, first-touch memory) before the first user
        request does, and teach the scheduler's step-time model, so that the ``ttft`` admission
        (``core/admission.py``) sizes the very first user steps. Call it while nothing else runs.
        They leave no trace: a scheduler of their own runs them (only the step-time model is
        shared), and afterwards every block is back in the pool, the prefix cache is empty and its
        counters are zero.
        """
        started = time.perf_counter()
        scheduler = self.scheduler
        self.scheduler = Scheduler(
            self.config.scheduler,
            self.kv_manager,
            self.max_model_len,
            step_time=scheduler.step_time,
            speculative=self.config.speculative_config,
        )
        vocab_size = int(self.source.hf_config.vocab_size)
        longest = max(
            1, min(self.max_model_len, self.kv_manager.capacity_tokens // 2) - WARM_UP_OUTPUT_TOKENS
        )
        params = SamplingParams(temperature=0.0, max_tokens=WARM_UP_OUTPUT_TOKENS, ignore_eos=True)
        try:
            for index, length in enumerate(WARM_UP_PROMPT_LENGTHS):
                length = min(length, longest)
                tokens = [(index * 1009 + 7919 * k) % vocab_size for k in range(length)]
                self.add_request(
                    EngineCoreRequest(
                        request_id=f"warm-up-{index}", prompt_token_ids=tokens, sampling_params=params
                    )
                )
                self.step()
            while self.scheduler.has_unfinished():
                self.step()
        finally:
            self.scheduler = scheduler
            if self._paused is not None:
                self.executor.discard_paused()
            self._second_pass = self._paused = None
        self.kv_manager.reset_prefix_cache()
        self.kv_manager.prefix_queried_tokens = self.kv_manager.prefix_hit_tokens = 0
        self.drain_kv_events()  # the warm-up's own: the frontend never knew of them
        return time.perf_counter() - started

    def drain_kv_events(self) -> list[KVEvent]:
        """The prefix cache's changes since the last call (empty unless ``publish_kv_events``)."""
        return self.kv_events.drain() if self.kv_events is not None else []

    def add_request(self, core_request: EngineCoreRequest) -> None:
        vocab_size = int(self.source.hf_config.vocab_size)
        bad = [t for t in core_request.prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        bias = core_request.sampling_params.logit_bias or {}
        bad = [t for t in bias if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if self.pause.released:
            raise ValueError("the engine's memory is released; resume_memory_occupation first")
        if self.config.deterministic and core_request.sampling_params.seed is None:
            # The deterministic mode's random draws come from the request's seed and the position
            # (sample/build.py position_generator); an unseeded request takes the engine's seed.
            params = dataclasses.replace(core_request.sampling_params, seed=self.config.model.seed)
            core_request = msgspec.structs.replace(core_request, sampling_params=params)
        request = Request(core_request, self.max_model_len)
        if core_request.lora_name is not None:
            if self.lora is None:
                raise ValueError(
                    f"LoRA adapter {core_request.lora_name!r} asked for, but LoRA is not enabled (enable_lora)"
                )
            self.lora.resolve(request, core_request.lora_name)
        if request.sampling_params.structured_outputs is not None:
            request.grammar = self.structured.new_state(request)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Finish the given requests with reason ``abort`` (unknown ids are ignored). Those of a paused
        step are finished when it has run to the end (their blocks are its to write until then)."""
        if self._paused is not None:
            in_paused = {entry.request_id for entry in self._paused.plan.scheduled}
            self._aborted_while_paused += [i for i in request_ids if i in in_paused]
            request_ids = [i for i in request_ids if i not in in_paused]
        return self.scheduler.abort(request_ids)

    def has_unfinished_requests(self) -> bool:
        """Whether a step has work: outputs queued by a utility call, or requests while not paused."""
        if self._queued_outputs:
            return True
        if self.pause.blocks_steps:
            return False
        return self.scheduler.has_unfinished() or self._second_pass is not None or self._paused is not None

    def step(self) -> EngineCoreOutputs:
        """One step (none while paused: ``core/pause.py``), with the outputs utility calls queued
        first; each output carries the weight version that produced its tokens."""
        if self.pause.blocks_steps:
            step = self._outputs([], 0, self.scheduler.num_forced_tokens_total)
        else:
            step = self._step()
        if self._queued_outputs:
            step.outputs[:0], self._queued_outputs = self._queued_outputs, []
        self._tag_weight_version(step.outputs)
        return step

    def settle_step(self) -> None:
        """Run the step under way to its end (a step paused between layers, a split step's second
        pass), queueing its outputs; then nothing is half computed (before a pause or an update)."""
        while self._paused is not None or self._second_pass is not None:
            outputs = self._step().outputs
            self._tag_weight_version(outputs)
            self._queued_outputs += outputs

    def queue_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """Send ``outputs`` with the next step's (a utility call's finished requests)."""
        self._tag_weight_version(outputs)
        self._queued_outputs += outputs

    def _tag_weight_version(self, outputs: list[EngineCoreOutput]) -> None:
        for output in outputs:
            if output.weight_version is None and output.new_token_ids:
                output.weight_version = self.weights.version

    def _step(self) -> EngineCoreOutputs:
        if self._paused is not None:
            return self._step_while_paused(self._paused)
        if (
            self._second_pass is not None
            and self._second_pass.pausable
            and self._arrival_passes_before_second < MAX_ARRIVAL_PASSES_PER_PAUSE
        ):
            # Arrivals that landed during the first pass would have paused the second one at its
            # first layer: their passes go first, as they would then.
            arrivals = self._arrivals_pass()
            if arrivals is not None:
                self._arrival_passes_before_second += 1
                return arrivals
        failed = self._fail_broken_grammars()
        forced_before = self.scheduler.num_forced_tokens_total
        started = time.perf_counter()
        plan = self._next_pass()
        plan.grammar_bitmask = self.structured.step_bitmask(plan.scheduled, self.scheduler.requests)
        if plan.is_empty and not failed and self.structured.has_pending():
            # Everything runnable waits for a grammar: block on the compiler rather than spin.
            self.structured.wait_for_compile(timeout=0.05)
        if self.lora is not None:
            self.lora.before_pass()
        result = self.executor.execute(plan)
        if result.status is StepStatus.ABANDONED:
            # Abandoned between layers for a latency-critical arrival: nothing of it counts, and it
            # is planned again after that request's step (step_control.py).
            self.scheduler.step_interrupted(plan)
            self.num_interrupted_steps += 1
            return self._outputs(failed, plan.num_preempted, forced_before)
        if result.status is StepStatus.PAUSED:
            # Paused between layers for arrivals with short prefills: their pass runs next, then
            # this one goes on (step_control.py).
            self._paused = PausedStep(plan, result.layers_done, time.perf_counter() - started)
            self.num_paused_steps += 1
            return self._outputs(failed, plan.num_preempted, forced_before)
        outputs = failed + self.scheduler.update(plan, result)
        self._record_step_time(plan, started)
        return self._outputs(outputs, plan.num_preempted, forced_before)

    def _step_while_paused(self, paused: PausedStep) -> EngineCoreOutputs:
        """A step while a planned step is paused: under ``lpm`` the step may first be put back
        (``Scheduler.replan_paused``); else an arrivals' pass (``Scheduler.schedule_beside``) while
        it has requests, up to ``MAX_ARRIVAL_PASSES_PER_PAUSE`` in a row; else the paused step goes
        on, and may pause again until it has paused ``MAX_PAUSES_PER_STEP`` times."""
        if (
            paused.arrival_passes == 0
            and self._second_pass is None
            and self.scheduler.replan_paused(paused.plan, self._fraction_done(paused))
        ):
            # Put back for waiting requests that now rank above it: plan anew (nothing was sent).
            self._paused = None
            self.executor.discard_paused()
            self.num_replanned_steps += 1
            aborted, self._aborted_while_paused = self._aborted_while_paused, []
            self.scheduler.abort(aborted)
            return self._step()
        forced_before = self.scheduler.num_forced_tokens_total
        if paused.arrival_passes < MAX_ARRIVAL_PASSES_PER_PAUSE:
            arrivals = self._arrivals_pass()
            # None left: the step goes on now, and at its next pause the arrivals' passes begin anew.
            paused.arrival_passes = (
                MAX_ARRIVAL_PASSES_PER_PAUSE if arrivals is None else paused.arrival_passes + 1
            )
            if arrivals is not None:
                return arrivals
        resumed = time.perf_counter()
        result = self.executor.resume(paused.num_pauses < MAX_PAUSES_PER_STEP)
        if result.status is StepStatus.PAUSED:
            paused.layers_done = result.layers_done
            paused.ran_seconds += time.perf_counter() - resumed
            paused.num_pauses += 1
            paused.arrival_passes = 0
            self.num_paused_steps += 1
            return self._outputs([], 0, forced_before)
        _expect_done(result, "a resumed step")
        self._paused = None
        # Aborted while paused: the step wrote their blocks to the end, so only now may they go.
        aborted, self._aborted_while_paused = self._aborted_while_paused, []
        self.scheduler.abort(aborted)
        outputs = self.scheduler.update(paused.plan, result)
        return self._outputs(outputs, 0, forced_before)

    def _fraction_done(self, paused: PausedStep) -> float:
        """The share of a paused step's work done: of its layers, or of its predicted time where the
        seconds it ran say more (a cold step's first layers take longer than the rest, and the time
        is what putting it back would lose)."""
        layers = paused.layers_done
        predicted = self.scheduler.step_time.predict(paused.plan.num_tokens, len(paused.plan.scheduled))
        return layers if not predicted else max(layers, min(1.0, paused.ran_seconds / predicted))

    def _arrivals_pass(self) -> EngineCoreOutputs | None:
        """A pass of waiting requests with short prefills (``Scheduler.schedule_beside``) run ahead of
        planned work that waits (a paused step, a step's second pass); None when none qualifies."""
        forced_before = self.scheduler.num_forced_tokens_total
        started = time.perf_counter()
        beside = self.scheduler.schedule_beside()
        if beside.is_empty:
            return None
        beside.grammar_bitmask = self.structured.step_bitmask(beside.scheduled, self.scheduler.requests)
        if self.lora is not None:
            self.lora.before_pass()
        result = self.executor.execute(beside)
        _expect_done(result, "an arrivals' pass")
        outputs = self.scheduler.update(beside, result)
        self._record_step_time(beside, started)
        return self._outputs(outputs, 0, forced_before)

    def _record_step_time(self, plan: SchedulerOutput, started: float) -> None:
        """Tell the scheduler how long ``plan`` took from ``started``: what a request arriving now
        waits for. The first step pays one-time costs (lazy initialization, cold caches) and is not
        recorded; neither is a step that paused (its time includes another pass)."""
        if self._timed_a_step:
            self.scheduler.record_step_time(plan, time.perf_counter() - started)
        self._timed_a_step = self._timed_a_step or not plan.is_empty

    def _next_pass(self) -> SchedulerOutput:
        """The second pass of the step under way (``core/first_token_pass.py``), without the requests
        that ended since its first pass; else a new plan, split in two passes where that is on, the
        plan finishes prompts beside other work and at most one request waits behind it."""
        if self._second_pass is not None:
            plan, self._second_pass = self._second_pass, None
            requests = self.scheduler.requests
            plan.scheduled = [
                entry
                for entry in plan.scheduled
                if entry.request_id in requests and requests[entry.request_id].status == RequestStatus.RUNNING
            ]
            return plan
        plan = self.scheduler.schedule()
        if self.config.scheduler.first_token_pass:
            passes = split_first_tokens(plan, self.scheduler.num_waiting)
            if passes is not None:
                plan, self._second_pass = passes
                self._arrival_passes_before_second = 0
                # The rest computes no first token of its own: it may pause where the whole plan may not.
                self._second_pass.pausable = self.scheduler.may_pause(self._second_pass.scheduled)
                self.num_split_steps += 1
        return plan

    def prefault_while_idle(self) -> bool:
        """Map the next few KV blocks' pages ahead of use (``CacheConfig.prefault``; a few
        milliseconds at most); whether more remain. For a caller with nothing else to do."""
        return self.executor.prefault_while_idle()

    def set_interrupt(self, flag: InterruptFlag | None) -> None:
        """Let steps the scheduler marks interruptible be abandoned when ``flag`` is raised
        (``step_control.py``)."""
        self.executor.set_interrupt(flag)

    def _outputs(
        self, outputs: list[EngineCoreOutput], num_preempted: int, forced_before: int
    ) -> EngineCoreOutputs:
        return EngineCoreOutputs(
            outputs=outputs,
            num_forced_tokens=self.scheduler.num_forced_tokens_total - forced_before,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_manager.usage(),
            num_preemptions=num_preempted,
            prefix_cache_queried_tokens=self.kv_manager.prefix_queried_tokens,
            prefix_cache_hit_tokens=self.kv_manager.prefix_hit_tokens,
            num_running_by_tier=self.scheduler.running_by_tier(),
            num_waiting_by_tier=self.scheduler.waiting.waiting_by_tier(),
            spec_num_draft_tokens=self.scheduler.spec.num_draft_tokens,
            spec_num_accepted_tokens=self.scheduler.spec.num_accepted_tokens,
            spec_accepted_per_position=list(self.scheduler.spec.accepted_at),
            kv_events=self.drain_kv_events(),
        )

    def _make_grammar_backend(self) -> GrammarBackend:
        # Imported on first use: xgrammar loads a native library engines without constraints never need.
        from tokenmill.structured.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(self.source.load_tokenizer(), int(self.source.hf_config.vocab_size))

    def _fail_broken_grammars(self) -> list[EngineCoreOutput]:
        """Finish the requests whose grammar failed to compile; their outputs carry the error."""
        outputs = []
        for request_id, error in self.structured.take_failures():
            output = self.scheduler.fail_request(request_id, error)
            if output is not None:
                outputs.append(output)
        return outputs

    def reset_prefix_cache(self) -> bool:
        return self.kv_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the executor's workers (a multi-process executor's child); idempotent. The core
        takes no more steps after it."""
        self.executor.shutdown()

    # ------------------------------------------------------------------ what every client calls

    def add_request_group(self, requests: list[EngineCoreRequest]) -> AddResult:
        """Admit ``requests`` (the n siblings of one user request) all or none.

        Contract: refused with ``overloaded=True`` and a ``retry_after`` estimate when the waiting
        queue (``max_waiting``) or the first request's tier's queue has no room for all of them;
        refused with the ``ValueError``'s message when one of them can never run, after taking back
        the siblings already admitted (siblings must not run alone). A refused group leaves the
        engine as it was, holding no blocks. Every client (in-process or the engine process) admits
        through this one function.
        """
        ids = [request.request_id for request in requests]
        tier = requests[0].service_tier if requests else None
        refusal = self.scheduler.queue_refusal(tier, len(ids))
        if refusal is not None:
            return AddResult(
                request_ids=ids, error=refusal, overloaded=True, retry_after=self.scheduler.retry_after()
            )
        added: list[str] = []
        try:
            for request in requests:
                self.add_request(request)
                added.append(request.request_id)
        except ValueError as exc:
            self.abort_requests(added)
            return AddResult(request_ids=ids, error=str(exc))
        return AddResult(request_ids=ids)

    def call_utility(
        self, method: str, args: dict[str, UtilityValue] | None = None
    ) -> dict[str, UtilityValue]:
        """Run the utility method ``method`` between steps and return its result (``UTILITY_METHODS``).

        Raises ValueError for an unknown method, and for one reserved for a later feature
        (``RESERVED_UTILITY_METHODS``) one saying it is not supported yet; whatever the method itself
        raises propagates. The engine process turns either into a ``UtilityResult`` error. The RL
        methods (weights, pause, memory) are ``core/weights.py``'s and ``core/pause.py``'s.
        """
        handler = self._utilities.get(method)
        if handler is not None:
            return handler(args or {})
        if method in RESERVED_UTILITY_METHODS:
            raise ValueError(f"the engine does not support {method!r} yet")
        known = ", ".join(UTILITY_METHODS)
        raise ValueError(f"unknown engine method {method!r}; the engine answers {known}")

    def _lora_utility(self, method: str, args: dict[str, UtilityValue]) -> dict[str, UtilityValue]:
        """``load_lora`` / ``unload_lora`` (``core/lora_engine.py``); an error without LoRA enabled."""
        if self.lora is None:
            raise ValueError(
                f"{method}: LoRA is not enabled (start the engine with enable_lora / --enable-lora)"
            )
        if method == "unload_lora":
            return self.lora.unload(str(args.get("lora_name") or ""))
        return self.lora.load(
            str(args.get("lora_name") or ""),
            str(args.get("lora_path") or ""),
            int(args.get("lora_int_id") or 0),  # type: ignore[arg-type]
        )

    def kv_stats(self) -> dict[str, UtilityValue]:
        """The KV cache's block counts (``KVCacheManager.stats``) and size (``kv_cache_tokens``,
        ``kv_cache_bytes``), the queues' lengths (also per tier, as ``num_running_<tier>`` and
        ``num_waiting_<tier>``) and the step counters."""
        scheduler = self.scheduler
        return {
            **self.kv_manager.stats(),
            "kv_cache_tokens": self.kv_manager.num_blocks * self.kv_manager.block_size,
            "kv_cache_bytes": self.executor.kv_cache_bytes,
            "num_running": scheduler.num_running,
            "num_waiting": scheduler.num_waiting,
            "num_preemptions": scheduler.num_preemptions_total,
            "num_interrupted_steps": self.num_interrupted_steps,
            "num_paused_steps": self.num_paused_steps,
            "num_replanned_steps": self.num_replanned_steps,
            "weight_version": self.weights.version,
            "paused": self.pause.blocks_steps,
            **scheduler.spec.stats(),
            **{f"num_running_{tier}": n for tier, n in scheduler.running_by_tier().items()},
            **{f"num_waiting_{tier}": n for tier, n in scheduler.waiting.waiting_by_tier().items()},
            **(self.lora.stats() if self.lora is not None else {}),
        }
