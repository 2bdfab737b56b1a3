"""Continuous batching under one rule: every request catches up towards its token count.

Each step the scheduler walks the running requests first, then admits waiting ones, giving each
``min(num_tokens - num_computed_tokens, budget left)`` tokens of the per-step token budget. There
are no prefill and decode phases: a chunked prompt, a resumed preempted request, a prefix-cache hit
and an ordinary decode all follow from this rule. When blocks run out, the lowest-ranked running
request (the most recently admitted) is preempted: its blocks are released and it is recomputed
later. Token ids only; no torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.config import SchedulerConfig
from tokenmill.core.kv.manager import KVCacheManager, cdiv
from tokenmill.core.policy import make_policy
from tokenmill.core.request import Request, RequestStatus
from tokenmill.protocol import EngineCoreOutput, FinishReason, PositionLogprobs
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.structured.manager import GrammarBitmask

logger = logging.getLogger(__name__)


@dataclass
class ScheduledRequest:
    """One request's share of a step: which tokens to compute and whether to sample after them.

    ``token_ids`` are the tokens at positions ``start_position .. start_position + len - 1``;
    ``block_table`` covers all of them. ``sample`` is set when this step reaches the end of the
    sequence, so the last position's logits pick the next token. ``prompt_logprobs_range`` is the
    half-open range of prompt positions whose next-token logprobs to compute this step.
    ``skipped_draws`` counts tokens jump-forward appended since the last sample: a seeded row skips
    that many draws, so its random stream is the one it would have had sampling them.
    """

    request_id: str
    token_ids: list[int]
    start_position: int
    block_table: list[int]
    sample: bool
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    forbidden_token_ids: list[int]
    prompt_logprobs_range: tuple[int, int] | None
    seed: int | None
    skipped_draws: int = 0


@dataclass
class SchedulerOutput:
    """A step's plan. ``finished_request_ids`` lists requests that ended since the last plan, so
    executors can drop per-request state (seeded generators). ``grammar_bitmask`` holds the allowed
    tokens of the constrained sampling rows (filled in by the engine core), or None."""

    scheduled: list[ScheduledRequest]
    finished_request_ids: list[str] = field(default_factory=list)
    num_preempted: int = 0
    grammar_bitmask: GrammarBitmask | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """What the executor computed: a token per sampling request, and the logprobs asked for."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)


class Scheduler:
    """Decides each step's batch and applies its results.

    Contract: ``add_request`` validates that the request can ever fit (raising ValueError
    otherwise), so preemption can always make progress; ``schedule`` never over-commits KV blocks;
    ``update`` turns model output into ``EngineCoreOutput`` messages and finishes requests;
    ``abort`` releases a request's blocks at once, wherever it is.
    """

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv_manager
        self.max_model_len = max_model_len
        prefix_length = kv_manager.peek_prefix_tokens if kv_manager.radix is not None else None
        self.waiting = make_policy(config.policy, prefix_length)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.num_preemptions_total = 0
        self.num_forced_tokens_total = 0  # appended by jump-forward

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise ValueError("the prompt must contain at least one token")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt has {request.num_prompt_tokens} tokens but the context window is "
                f"{self.max_model_len} tokens (prompt plus at least one output token)"
            )
        total = request.num_prompt_tokens + request.max_tokens
        if cdiv(total, self.kv.block_size) > self.kv.num_blocks:
            raise ValueError(
                f"the request needs {total} tokens of KV cache but the whole pool holds "
                f"{self.kv.capacity_tokens}; lower max_tokens or give the cache more memory"
            )
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort(self, request_ids: list[str]) -> list[str]:
        """Finish the given requests with reason ``abort``; unknown ids are ignored."""
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.finish_reason = FinishReason.ABORT
            self._finish(request)
            aborted.append(request_id)
        return aborted

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ------------------------------------------------------------------ planning a step

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        plan: list[ScheduledRequest] = []
        num_preempted = 0

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                num_preempted += 1
                if victim is request:
                    break
            else:
                plan.append(self._plan_entry(request, num_new))
                budget -= num_new
                i += 1

        # Admitting new work right after a preemption would only thrash the cache.
        if num_preempted == 0:
            budget = self._admit_waiting(plan, budget)

        finished, self._finished_ids = self._finished_ids, []
        self.num_preemptions_total += num_preempted
        return SchedulerOutput(scheduled=plan, finished_request_ids=finished, num_preempted=num_preempted)

    def _admit_waiting(self, plan: list[ScheduledRequest], budget: int) -> int:
        for request in self.waiting.ordered():
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if not self._grammar_ready(request):
                continue  # its grammar is still compiling; it does not hold up the queue
            leader = self._sibling_leader(request)
            if leader is not None and not self._leader_prompt_ready(leader, request):
                continue  # wait until the leader has computed the shared prompt blocks
            if leader is not None:
                computed = self.kv.share_prefix(leader.request_id, request, request.num_prompt_tokens - 1)
            else:
                computed = self.kv.match_prefix(request)
            request.num_computed_tokens = computed
            num_new = min(request.num_tokens - computed, budget)
            if not self.kv.allocate_slots(request, num_new):
                self.kv.free(request.request_id)
                request.num_computed_tokens = 0
                break  # head-of-line: do not let later requests jump the queue for blocks
            if request.num_preemptions == 0:
                request.num_cached_tokens = computed
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.append(self._plan_entry(request, num_new))
            budget -= num_new
        return budget

    @staticmethod
    def _grammar_ready(request: Request) -> bool:
        return request.grammar is None or request.grammar.poll()

    def _sibling_leader(self, request: Request) -> Request | None:
        """The running first sibling whose prompt blocks this request may share, if any."""
        if request.group_id is None or request.sibling_index == 0 or request.num_preemptions > 0:
            return None
        leader = self.requests.get(f"{request.group_id}-0")
        if leader is None or leader.prompt_token_ids != request.prompt_token_ids:
            return None
        return leader

    def _leader_prompt_ready(self, leader: Request, request: Request) -> bool:
        full_prompt_tokens = (request.num_prompt_tokens - 1) // self.kv.block_size * self.kv.block_size
        if full_prompt_tokens == 0:
            return True
        return leader.status == RequestStatus.RUNNING and leader.num_computed_tokens >= full_prompt_tokens

    def _plan_entry(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        prompt_range = None
        if request.wants_prompt_logprobs:
            lo = max(start, request.num_prompt_logprobs_done)
            hi = min(end, request.num_prompt_tokens - 1)
            if lo < hi:
                prompt_range = (lo, hi)
        params = request.sampling_params
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:end],
            start_position=start,
            block_table=self.kv.block_table(request.request_id),
            sample=end == request.num_tokens,
            sampling_params=params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            forbidden_token_ids=request.tokens_forbidden_now(),
            prompt_logprobs_range=prompt_range,
            seed=None if params.seed is None else params.seed + request.sibling_index,
            skipped_draws=request.num_forced_since_sample if end == request.num_tokens else 0,
        )

    def _preempt(self, request: Request) -> None:
        """Release the request's blocks and queue it to be recomputed from scratch."""
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.prepend(request)
        logger.debug("preempted request %s", request.request_id)

    # ------------------------------------------------------------------ applying a step's results

    def update(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        for entry in plan.scheduled:
            request = self.requests.get(entry.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += len(entry.token_ids)
            chunk_logprobs = result.prompt_logprobs.get(entry.request_id)
            if chunk_logprobs is not None:
                request.pending_prompt_logprobs.extend(chunk_logprobs)
                request.num_prompt_logprobs_done += len(chunk_logprobs)
            self.kv.cache_computed_blocks(request)
            if not entry.sample:
                continue
            new_tokens, stopped = self._append_tokens(request, result.sampled_token_ids[entry.request_id])
            output = EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=new_tokens,
                num_cached_tokens=request.num_cached_tokens,
            )
            if entry.request_id in result.logprobs:
                output.new_logprobs = [result.logprobs[entry.request_id]]
            if request.num_output_tokens == 1 and request.wants_prompt_logprobs:
                output.prompt_logprobs = request.pending_prompt_logprobs
                request.pending_prompt_logprobs = []
            if stopped:
                self.running.remove(request)
                self._finish(request)
                output.finish_reason = request.finish_reason
                output.stop_reason = request.stop_reason
                output.error = request.error
            outputs.append(output)
        return outputs

    def _append_tokens(self, request: Request, sampled: int) -> tuple[list[int], bool]:
        """Append the sampled token, then any tokens the request's grammar forces (jump-forward).

        Each token goes through the grammar and the stop checks; appending ends at the first token
        that finishes the request. Returns the appended tokens and whether the request finished.
        """
        appended = [sampled]
        stopped = self._append_one(request, sampled)
        grammar = request.grammar
        while not stopped and grammar is not None and (forced := grammar.forced_token()) is not None:
            appended.append(forced)
            stopped = self._append_one(request, forced)
        request.num_forced_since_sample = len(appended) - 1
        self.num_forced_tokens_total += len(appended) - 1
        return appended, stopped

    @staticmethod
    def _append_one(request: Request, token: int) -> bool:
        request.append_output_token(token)
        if request.grammar is not None and not request.grammar.accept(token):
            # The bitmask makes this unreachable; if it happens, fail this request, not the engine.
            request.finish_reason = FinishReason.ERROR
            request.error = f"token {token} is not allowed by the request's grammar"
            return True
        return request.check_stop()

    def fail_request(self, request_id: str, error: str) -> EngineCoreOutput | None:
        """Finish a request that cannot run (its grammar failed to compile) with ``error``.

        Returns the output that tells the client, or None when the request is already gone.
        """
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.finish_reason = FinishReason.ERROR
        self._finish(request)
        return EngineCoreOutput(
            request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ERROR, error=error
        )

    def _finish(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED
        self.kv.free(request.request_id)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
