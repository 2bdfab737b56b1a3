"""Continuous batching under one rule: every request catches up towards its token count.

Each step the scheduler walks the running requests first, then admits waiting ones, giving each
``min(num_tokens - num_computed_tokens, budget left)`` tokens of the per-step token budget. There
are no prefill and decode phases: a chunked prompt, a resumed preempted request, a prefix-cache hit
and an ordinary decode all follow from this rule. Under ``admission="ttft"`` a step admits no
more waiting requests than keeps their mean time to first token least (``core/admission.py``).
Requests are grouped into scheduling classes
(service tier, then priority; ``core/tiers.py``) served best first, each class's running requests
before its waiting ones. When blocks run out, the lowest-ranked running request (worst class, then
most recently admitted) is preempted: its blocks are released and it is recomputed later. Requests
past their deadline end with ``timeout`` at the start of a step. While a tier has a TTFT target,
worse tiers' chunks are cut to keep steps short (``core/step_time.py`` predicts step times from the
measured ones the engine core reports), no longer than that tier's recent first-token steps take,
and a step where a request of that tier awaits its first token serves only that tier and better
ones. Token ids only; no torch.

This file holds the rule's two loops, ``schedule`` and ``update``; each feature's own rules live in
a module of their own: ``admission.py`` (how many waiting requests a step admits),
``preemption.py`` (whom to preempt), ``prefix_sharing.py`` (sharing blocks still being computed),
``step_bounds.py`` (TTFT step budgets, exclusive steps, cuts), ``arrivals.py`` (pausing a step for
short arrivals, putting a paused step back), ``deadlines.py``, ``output_tokens.py`` (jump-forward)
and ``overload.py`` (refusing requests the queue has no room for).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from tokenmill.config import SchedulerConfig, SpeculativeConfig
from tokenmill.core import arrivals, overload
from tokenmill.core.admission import arrival_pass_cap, step_admission_cap
from tokenmill.core.deadlines import mark_timed_out, past_deadline
from tokenmill.core.fairness import VirtualTokenCounters
from tokenmill.core.kv.manager import KVCacheManager, cdiv
from tokenmill.core.lora_slots import LoRASlotTable
from tokenmill.core.output_tokens import append_tokens
from tokenmill.core.policy import make_policy
from tokenmill.core.preemption import lowest_ranked_running, preempt
from tokenmill.core.prefix_sharing import (
    leader_prompt_ready,
    planned_prefills,
    prefix_in_flight,
    sibling_leader,
)
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.spec_decode import SpecDecodeState
from tokenmill.core.step_bounds import StepBounds
from tokenmill.core.step_io import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from tokenmill.core.step_time import StepTimeModel
from tokenmill.core.tiers import ClassKey, StepBudget, TieredQueue, TierTable
from tokenmill.protocol import EngineCoreOutput, FinishReason

logger = logging.getLogger(__name__)


class Scheduler:
    """Decides each step's batch and applies its results.

    Contract: ``add_request`` validates that the request can ever fit (raising ValueError
    otherwise), so preemption can always make progress; ``schedule`` never over-commits KV blocks;
    ``update`` turns model output into ``EngineCoreOutput`` messages and finishes requests;
    ``abort`` releases a request's blocks at once, wherever it is. ``clock`` (``time.time`` by
    default, the clock of ``arrival_time`` and ``deadline``) is injectable so tests need no wall clock;
    so is ``step_time``, the model fed by ``record_step_time`` with the measured time of each step.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        max_model_len: int,
        clock: Callable[[], float] = time.time,
        step_time: StepTimeModel | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.config = config
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.clock = clock
        self.step_time = step_time if step_time is not None else StepTimeModel()
        # The requests whose blocks computed by the step being planned others of it share.
        self._shared_sources: list[str] = []
        self._admissions_left: int | None = None  # of the step being planned; None: no cap
        prefix_length = kv_manager.peek_prefix_tokens if kv_manager.radix is not None else None
        self.tiers = TierTable(config)
        self.bounds = StepBounds(config, self.tiers)
        self.fairness = (
            VirtualTokenCounters(config.fair_input_weight, config.fair_output_weight, config.user_weights)
            if config.policy == "vtc"
            else None
        )
        make_policy(config.policy, prefix_length, self.fairness)  # fail at start-up, not at first use
        self.waiting = TieredQueue(
            self.tiers, lambda: make_policy(config.policy, prefix_length, self.fairness), self.fairness
        )
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        # Outputs the scheduler produced on its own (deadline expiry), sent with the next update.
        self._pending_outputs: list[EngineCoreOutput] = []
        self._recent_finishes: deque[float] = deque(maxlen=64)
        self.num_preemptions_total = 0
        self.num_forced_tokens_total = 0  # appended by jump-forward
        # LoRA device slots (``core/lora_slots.py``), set by the engine core when LoRA is on.
        self.lora_slots: LoRASlotTable | None = None
        # Speculative decoding's drafts per step and verification results (core/spec_decode.py).
        self.spec = SpecDecodeState(speculative, self.step_time)

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
        self.spec.check_request(request)
        request.tier = self.tiers.resolve(request.tier)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def queue_refusal(self, service_tier: str | None, num_requests: int) -> str | None:
        """Why ``num_requests`` more requests of ``service_tier`` may not wait now, or None if they
        may (``core/overload.py``)."""
        return overload.queue_refusal(self.config, self.tiers, self.waiting, service_tier, num_requests)

    def retry_after(self) -> float:
        """Seconds a refused client should wait, between 1 and 60 (``core/overload.py``)."""
        return overload.retry_after(self._recent_finishes, self.num_waiting)

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

    def running_by_tier(self) -> dict[str, int]:
        counts = dict.fromkeys(self.tiers.names, 0)
        for request in self.running:
            counts[request.tier] += 1
        return counts

    # ------------------------------------------------------------------ planning a step

    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        self._expire_deadlines(now)
        budget = self._step_budget(now)
        self.spec.begin_step(len(self.running))
        exclusive_rank = self.bounds.exclusive_rank(self.requests.values())
        plan: list[ScheduledRequest] = []
        num_preempted = 0  # running requests that ran out of blocks
        num_made_room = 0  # worse-class requests preempted to admit better ones
        admitting = True
        exclusive = False
        self._admissions_left = step_admission_cap(
            self.config, self.step_time, self.kv, self.requests.values(), self.running, self.num_waiting
        )
        for key in self._class_keys():
            if (
                exclusive_rank is not None
                and key[0] > exclusive_rank
                and self.bounds.plans_first_token(plan, self.requests)
            ):
                # A first token within a TTFT target is on its way: worse tiers sit this step out
                # so it runs as on an idle server, and resume in the next one.
                exclusive = True
                break
            num_preempted += self._schedule_running(key, plan, budget)
            # Admitting new work right after a preemption would only thrash the cache.
            if admitting and num_preempted == 0:
                admitting, made_room = self._admit_waiting(key, plan, budget)
                num_made_room += made_room
                # What was preempted to make room must not be readmitted (recomputed) in this step.
                admitting = admitting and made_room == 0
        finished, self._finished_ids = self._finished_ids, []
        self.num_preemptions_total += num_preempted + num_made_room
        interruptible = self.bounds.may_be_cut(plan, self.requests, bool(self._shared_sources))
        self.bounds.planned(exclusive)
        shared_sources, self._shared_sources = self._shared_sources, []
        return SchedulerOutput(
            scheduled=plan,
            finished_request_ids=finished,
            num_preempted=num_preempted + num_made_room,
            first_token_exclusive=exclusive,
            interruptible=interruptible,
            pausable=self.may_pause(plan),
            shared_sources=shared_sources,
            propose_drafts=self.spec.propose_next,
        )

    def schedule_beside(self) -> SchedulerOutput:
        """A pass of its own for the waiting requests with a short prefill, while a planned step the
        model paused between layers waits to go on (``step_control.py``).

        Admits, in class and policy order, each waiting request whose prompt needs at most
        ``short_prefill_interrupt`` tokens beyond the prefix cache, computing all of them, within
        the step's token budget (with its tiers' caps and time bound, as ``schedule`` plans) and the
        seat limits; never preempts (the paused step's requests
        keep their blocks) and plans no running request. Requests that wait for blocks a running
        request computes (a shared prefix in flight, an n > 1 sibling) are left to the next plan.
        Under ``admission="ttft"`` it admits as many as keep those arrivals' mean time to first token
        least (``core/admission.py``, with only the pass's fixed cost as overhead: on a CPU two
        arrivals' prefills take as long together as one after the other, so the first gets its token
        in half the time); the engine core then runs another such pass for the rest before the
        paused step goes on. The plan is neither interruptible nor pausable and may be empty.
        """
        plan: list[ScheduledRequest] = []
        budget = self._step_budget(self.clock())
        admissions_left = self._arrival_pass_cap()
        for key in sorted(self.waiting.class_keys()):
            for request in self.waiting.ordered_in(key):
                if len(self.running) >= self.config.max_num_seqs or admissions_left == 0:
                    break
                num_new = request.num_tokens - self.kv.peek_prefix_tokens(request)
                if (
                    num_new > self.config.short_prefill_interrupt
                    or budget.grant(request.tier, num_new) < num_new
                    or self._tier_is_full(request.tier)
                    or not self._grammar_ready(request)
                    or not self._lora_fits(request)
                    or sibling_leader(self.requests, request) is not None
                    or prefix_in_flight(self.running, self.tiers, self.kv, key, request)
                ):
                    continue
                request.num_computed_tokens = self.kv.match_prefix(request)
                num_new = request.num_tokens - request.num_computed_tokens
                if not self.kv.allocate_slots(request, num_new):
                    self.kv.free(request.request_id)
                    request.num_computed_tokens = 0
                    return SchedulerOutput(scheduled=plan)  # no blocks without preemption
                self._start_running(request, request.num_computed_tokens, plan)
                budget.take(request.tier, num_new)
                if admissions_left is not None:
                    admissions_left -= 1
        return SchedulerOutput(scheduled=plan)

    def _arrival_pass_cap(self) -> int | None:
        """How many short arrivals an arrivals' pass admits (``core/admission.py``); None: all it may."""
        return arrival_pass_cap(self.config, self.step_time, self.kv, self.requests.values())

    def replan_paused(self, plan: SchedulerOutput, fraction_done: float) -> bool:
        """Put a barely started step back when the waiting queue's policy now puts a waiting request
        before all of its requests, the work lost counted (only ``lpm`` does: a burst of requests
        sharing a new prefix arrived just after an unrelated prompt started; ``WaitingPolicy.outranks``);
        True when it did. The step (paused between layers with ``fraction_done`` of its work done, by
        layers or by time) must qualify (``arrivals.replannable``): its requests release their blocks
        and wait again at the front of their class, ranked with the rest (``arrivals.put_back``); the
        caller drops the paused step. A request is put back at most once, so none waits for ever."""
        found = arrivals.replannable(plan, fraction_done, self.requests, self.tiers)
        if found is None:
            return False
        started, key = found
        if not self.waiting.outranks_in(key, started, fraction_done):
            return False
        arrivals.put_back(started, self.running, self.kv, self.waiting)
        return True

    def step_interrupted(self, plan: SchedulerOutput) -> None:
        """``plan`` was abandoned between layers (``step_control.py``): nothing of it was computed, so
        nothing changes but that the next step may not be cut (worse tiers always make progress).
        Its requests keep their reserved blocks and are planned again."""
        self.bounds.step_interrupted()

    def _step_budget(self, now: float) -> StepBudget:
        """The token budget of the step being planned (``StepBounds.budget``)."""
        return self.bounds.budget(
            now, self.requests.values(), len(self.running), self.step_time, self.kv.block_size
        )

    def may_pause(self, plan: list[ScheduledRequest]) -> bool:
        """Whether ``plan`` may be paused between layers for arrivals with a short prefill
        (``schedule_beside``; the rule is ``arrivals.may_pause``)."""
        return arrivals.may_pause(plan, self.config.short_prefill_interrupt, self.bounds, self.requests)

    def _class_keys(self) -> list[ClassKey]:
        """The scheduling classes with running or waiting requests, best first."""
        running = {self.tiers.class_key(r) for r in self.running}
        return sorted(running.union(self.waiting.class_keys()))

    def _schedule_running(self, key: ClassKey, plan: list[ScheduledRequest], budget: StepBudget) -> int:
        """Plan the running requests of class ``key`` in admission order; returns how many requests
        were preempted for blocks (always the lowest-ranked running ones, maybe the asker itself)."""
        num_preempted = 0
        for request in [r for r in self.running if self.tiers.class_key(r) == key]:
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            # Draft tokens are extra tokens to compute under the one rule (core/spec_decode.py).
            wanted = request.num_tokens - request.num_computed_tokens + self.spec.num_drafts_to_plan(request)
            num_new = budget.grant(request.tier, wanted, running=True)
            if num_new == 0:
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = lowest_ranked_running(self.running, self.tiers)
                preempt(victim, self.running, self.kv, self.waiting)
                num_preempted += 1
                if victim is request:
                    break
            else:
                plan.append(self._plan_entry(request, num_new))
                budget.take(request.tier, num_new, running=True)
        return num_preempted

    def _make_room_for(self, key: ClassKey) -> bool:
        """Preempt one running request of a class worse than ``key``; False when there is none."""
        try:
            victim = lowest_ranked_running(self.running, self.tiers, worse_than=key)
        except KeyError:
            return False
        preempt(victim, self.running, self.kv, self.waiting)
        return True

    def _admit_waiting(
        self, key: ClassKey, plan: list[ScheduledRequest], budget: StepBudget
    ) -> tuple[bool, int]:
        """Admit waiting requests of class ``key`` in policy order, preempting worse classes for seats
        and blocks. Returns whether worse classes may still be admitted this step, and how many
        requests were preempted to make room."""
        num_made_room = 0
        for request in self.waiting.ordered_in(key):
            if budget.total_left <= 0 or self._admissions_left == 0:
                return False, num_made_room
            tier = self.tiers.tiers[request.tier]
            if budget.exhausted(request.tier) or self._tier_is_full(request.tier):
                break  # this tier is done for the step; worse classes may still use what is left
            if not self._grammar_ready(request):
                continue  # its grammar is still compiling; it does not hold up the queue
            if not self._lora_fits(request):
                continue  # every LoRA slot holds a running adapter; it waits for one to free up
            leader = sibling_leader(self.requests, request)
            if leader is not None and not leader_prompt_ready(leader, request, plan, self.kv):
                continue  # wait until the leader's step computes the shared prompt blocks
            source_id, source_tokens = "", 0
            if leader is None and prefix_in_flight(self.running, self.tiers, self.kv, key, request):
                source_id, source_tokens = self.kv.prefix_computed_by(
                    request, planned_prefills(self.requests, self.tiers, key, plan)
                )
                if not source_tokens:
                    continue  # match the shared blocks once a running request has computed them
            if len(self.running) >= self.config.max_num_seqs:
                if not self._make_room_for(key):
                    return False, num_made_room
                num_made_room += 1
            if leader is not None:
                computed = self.kv.share_prefix(leader.request_id, request, request.num_prompt_tokens - 1)
                if leader.num_computed_tokens < computed:
                    self._shared_sources.append(leader.request_id)
            elif source_tokens:
                # The blocks are computed by this very step, ahead of this request's attention.
                computed = self.kv.share_prefix(source_id, request, source_tokens, count_as_hit=True)
                self._shared_sources.append(source_id)
            else:
                computed = self.kv.match_prefix(request)
            request.num_computed_tokens = computed
            num_new = budget.grant(tier.name, request.num_tokens - computed)
            while not self.kv.allocate_slots(request, num_new):
                if not self._make_room_for(key):
                    self.kv.free(request.request_id)
                    request.num_computed_tokens = 0
                    # Head-of-line: do not let later or worse requests jump the queue for blocks.
                    return False, num_made_room
                num_made_room += 1
            self._start_running(request, computed, plan, num_new)
            budget.take(tier.name, num_new)
            if self._admissions_left is not None:
                self._admissions_left -= 1
        return True, num_made_room

    def _start_running(
        self, request: Request, computed: int, plan: list[ScheduledRequest], num_new: int | None = None
    ) -> None:
        """Move an admitted waiting request (``computed`` tokens cached, blocks allocated) to the
        running ones, with ``num_new`` of its tokens (default: all the rest) in ``plan``."""
        if request.num_preemptions == 0:
            request.num_cached_tokens = computed
        if request.wants_prompt_logprobs and computed > request.num_prompt_logprobs_done:
            # Cached positions (all before ``prompt_logprobs_start``) have no logits: their entries are None.
            request.pending_prompt_logprobs.extend([None] * (computed - request.num_prompt_logprobs_done))
            request.num_prompt_logprobs_done = computed
        if self.lora_slots is not None:
            self.lora_slots.acquire(request.lora_id, (r.lora_id for r in self.running))
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        plan.append(self._plan_entry(request, request.num_tokens - computed if num_new is None else num_new))

    def _tier_is_full(self, tier_name: str) -> bool:
        limit = self.tiers.tiers[tier_name].max_running
        return limit is not None and sum(r.tier == tier_name for r in self.running) >= limit

    def _expire_deadlines(self, now: float) -> None:
        """End every request whose deadline has passed with ``timeout`` (``core/deadlines.py``)."""
        for request in past_deadline(self.requests.values(), now):
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            timed_out = mark_timed_out(request)
            self._finish(request)
            self._pending_outputs.append(timed_out)
            logger.debug("request %s passed its deadline", request.request_id)

    @staticmethod
    def _grammar_ready(request: Request) -> bool:
        return request.grammar is None or request.grammar.poll()

    def _lora_fits(self, request: Request) -> bool:
        """Whether ``request``'s adapter holds a LoRA slot or can get one (``core/lora_slots.py``)."""
        slots = self.lora_slots
        return slots is None or slots.fits(request.lora_id, (r.lora_id for r in self.running))

    def _plan_entry(self, request: Request, num_new: int) -> ScheduledRequest:
        """The entry computing ``num_new`` tokens from ``num_computed_tokens`` on: past ``num_tokens``
        they are the request's drafts (``_schedule_running`` granted at most those planned)."""
        start = request.num_computed_tokens
        end = start + num_new
        drafts = request.draft_token_ids[: max(0, end - request.num_tokens)]
        prompt_range = None
        if request.wants_prompt_logprobs:
            lo = max(start, request.num_prompt_logprobs_done)
            hi = min(end, request.num_prompt_tokens - 1)
            if lo < hi:
                prompt_range = (lo, hi)
        params = request.sampling_params
        entry = ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start : end - len(drafts)] + drafts,
            start_position=start,
            block_table=self.kv.block_table(request.request_id),
            sample=end >= request.num_tokens and request.max_tokens > 0,
            sampling_params=params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            forbidden_token_ids=request.tokens_forbidden_now(),
            prompt_logprobs_range=prompt_range,
            seed=None if params.seed is None else params.seed + request.sibling_index,
            skipped_draws=request.num_forced_since_sample if end >= request.num_tokens else 0,
            draft_token_ids=drafts,
            lora_slot=-1 if self.lora_slots is None else self.lora_slots.slot_of(request.lora_id),
        )
        self.kv.plan_state(request, entry)  # recurrent-state slots and checkpoints (core/kv/hybrid.py)
        return entry

    # ------------------------------------------------------------------ applying a step's results

    def record_step_time(self, plan: SchedulerOutput, seconds: float) -> None:
        """Feed the measured wall time of ``plan``'s step (schedule to update) to the step-time model."""
        if not plan.is_empty:
            self.step_time.observe(plan.num_tokens, len(plan.scheduled), seconds)
            self.spec.observe_step(plan, seconds)
        self.bounds.observe(plan, seconds)

    def update(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        now = self.clock()
        for entry in plan.scheduled:
            request = self.requests.get(entry.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += len(entry.token_ids) - len(entry.draft_token_ids)
            self._charge_prompt(request)
            chunk_logprobs = result.prompt_logprobs.get(entry.request_id)
            if chunk_logprobs is not None:
                request.pending_prompt_logprobs.extend(chunk_logprobs)
                request.num_prompt_logprobs_done += len(chunk_logprobs)
            self.kv.cache_computed_blocks(request)
            self.kv.release_out_of_window_blocks(request)
            if not entry.sample:
                if request.max_tokens == 0 and request.num_computed_tokens == request.num_tokens:
                    outputs.append(self._finish_prompt_only(request))
                continue
            if entry.draft_token_ids:
                verified = result.verified_token_ids[entry.request_id]
                new_tokens, stopped = self.spec.apply_verified(request, entry, verified, self.kv)
            else:
                new_tokens, stopped = append_tokens(request, result.sampled_token_ids[entry.request_id])
                self.num_forced_tokens_total += len(new_tokens) - 1
            request.draft_token_ids = result.draft_token_ids.get(entry.request_id, [])
            self._record_tokens(request, len(new_tokens), now)
            output = EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=new_tokens,
                num_cached_tokens=request.num_cached_tokens,
            )
            if entry.request_id in result.verified_logprobs:
                output.new_logprobs = result.verified_logprobs[entry.request_id][: len(new_tokens)]
            elif entry.request_id in result.logprobs:
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

    def _finish_prompt_only(self, request: Request) -> EngineCoreOutput:
        """End a ``max_tokens=0`` request whose prompt is computed: no token is sampled, its full
        blocks stay in the prefix cache, its prompt logprobs (if asked for) go out now."""
        self.running.remove(request)
        request.finish_reason = FinishReason.LENGTH
        self._finish(request)
        output = EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            num_cached_tokens=request.num_cached_tokens,
            finish_reason=FinishReason.LENGTH,
        )
        if request.wants_prompt_logprobs:
            output.prompt_logprobs = request.pending_prompt_logprobs
            request.pending_prompt_logprobs = []
        return output

    def _charge_prompt(self, request: Request) -> None:
        """Charge the user for prompt positions computed for the first time (recomputation is free)."""
        computed_prompt = min(request.num_computed_tokens, request.num_prompt_tokens)
        if computed_prompt > request.num_prompt_charged:
            self.waiting.charge(request, computed_prompt - request.num_prompt_charged, 0)
            request.num_prompt_charged = computed_prompt

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

    def _record_tokens(self, request: Request, count: int, now: float) -> None:
        """Charge the user for ``count`` generated tokens (a sample plus any tokens a grammar forced)
        and note when they came (for TTFT/TPOT targets)."""
        self.waiting.charge(request, 0, count)
        if request.first_token_time is None:
            request.first_token_time = now
        elif request.last_token_time is not None:
            request.last_token_interval = now - request.last_token_time
        request.last_token_time = now

    def _finish(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED
        self.kv.free(request.request_id)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
        self._recent_finishes.append(self.clock())
