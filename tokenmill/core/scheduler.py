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
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable

from tokenmill.config import SchedulerConfig
from tokenmill.core.admission import ttft_admission_cap
from tokenmill.core.fairness import VirtualTokenCounters
from tokenmill.core.kv.manager import KVCacheManager, cdiv
from tokenmill.core.policy import make_policy
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.step_io import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from tokenmill.core.step_time import StepTimeModel
from tokenmill.core.tiers import ClassKey, StepBudget, TieredQueue, TierTable
from tokenmill.protocol import EngineCoreOutput, FinishReason

logger = logging.getLogger(__name__)

# How many recent first-token steps of their own bound the steps of worse tiers (their median).
FIRST_TOKEN_STEPS_KEPT = 16
# A paused step of fresh prompts that has run at most this share of its layers may be put back when
# waiting requests rank above its own (``Scheduler.replan_paused``): little is recomputed.
REPLAN_MAX_FRACTION_DONE = 0.25
# How many waiting requests (the oldest) the ``ttft`` admission averages the prompt work of.
ADMISSION_SAMPLE = 32


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
    ) -> None:
        self.config = config
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.clock = clock
        self.step_time = step_time if step_time is not None else StepTimeModel()
        # Consecutive steps that served only a tier awaiting a first token within a TTFT target.
        self._exclusive_streak = 0
        # Measured seconds of the recent such steps (see _step_time_target).
        self._first_token_step_times: deque[float] = deque(maxlen=FIRST_TOKEN_STEPS_KEPT)
        # Whether the last planned step was abandoned (step_interrupted): the next one is not cut.
        self._last_step_interrupted = False
        # The requests whose blocks computed by the step being planned others of it share.
        self._shared_sources: list[str] = []
        self._admissions_left: int | None = None  # of the step being planned; None: no cap
        prefix_length = kv_manager.peek_prefix_tokens if kv_manager.radix is not None else None
        self.tiers = TierTable(config)
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
        request.tier = self.tiers.resolve(request.tier)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def queue_refusal(self, service_tier: str | None, num_requests: int) -> str | None:
        """Why ``num_requests`` more requests of ``service_tier`` may not wait now, or None if they may.

        Checks the whole waiting queue's bound (``max_waiting``) and the tier's own. An unknown tier
        is left to ``add_request``, which raises ValueError for it.
        """
        bound = self.config.max_waiting
        waiting = self.num_waiting
        if bound is not None and waiting + num_requests > bound:
            return f"the server is overloaded: {waiting} requests are already waiting (limit {bound}); retry later"
        try:
            tier = self.tiers.resolve(service_tier)
        except ValueError:
            return None
        tier_bound = self.tiers.tiers[tier].max_waiting
        tier_waiting = self.waiting.num_waiting_in(tier)
        if tier_bound is not None and tier_waiting + num_requests > tier_bound:
            return (
                f"the {tier!r} service tier is overloaded: {tier_waiting} requests are already waiting "
                f"(limit {tier_bound}); retry later"
            )
        return None

    def retry_after(self) -> float:
        """Seconds a refused client should wait: how long the recent finish rate takes to drain the
        waiting queue, between 1 and 60 seconds (1 before anything has finished)."""
        finishes = self._recent_finishes
        if len(finishes) < 2 or finishes[-1] <= finishes[0]:
            return 1.0
        rate = (len(finishes) - 1) / (finishes[-1] - finishes[0])
        return float(min(60, max(1, math.ceil(self.num_waiting / rate))))

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
        exclusive_rank = self._exclusive_rank()
        plan: list[ScheduledRequest] = []
        num_preempted = 0  # running requests that ran out of blocks
        num_made_room = 0  # worse-class requests preempted to admit better ones
        admitting = True
        exclusive = False
        self._admissions_left = self._admission_cap()
        for key in self._class_keys():
            if exclusive_rank is not None and key[0] > exclusive_rank and self._plans_first_token(plan):
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
        self._exclusive_streak = self._exclusive_streak + 1 if exclusive else 0
        finished, self._finished_ids = self._finished_ids, []
        self.num_preemptions_total += num_preempted + num_made_room
        interruptible = self._may_be_cut(plan)
        self._last_step_interrupted = False
        shared_sources, self._shared_sources = self._shared_sources, []
        return SchedulerOutput(
            scheduled=plan,
            finished_request_ids=finished,
            num_preempted=num_preempted + num_made_room,
            first_token_exclusive=exclusive,
            interruptible=interruptible,
            pausable=self.may_pause(plan),
            shared_sources=shared_sources,
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
                    or self._sibling_leader(request) is not None
                    or self._prefix_in_flight(key, request)
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
        """How many short arrivals an arrivals' pass admits (``schedule_beside``): None (all it may)
        unless ``admission="ttft"``, else ``ttft_admission_cap`` over the waiting requests whose
        prompts are short beyond their cached prefixes, with nothing running in the pass."""
        if self.config.admission != "ttft":
            return None
        limit = self.config.short_prefill_interrupt
        waiting = (r for r in self.requests.values() if r.status != RequestStatus.RUNNING)
        short = [n for n in (r.num_tokens - self.kv.peek_prefix_tokens(r) for r in waiting) if n <= limit]
        if not short:
            return None
        return ttft_admission_cap(self.step_time, 0, 0, len(short), statistics.fmean(short))

    def replan_paused(self, plan: SchedulerOutput, fraction_done: float) -> bool:
        """Put a barely started step back when the waiting queue's policy now puts a waiting request
        before all of its requests, the work lost counted (only ``lpm`` does: a burst of requests
        sharing a new prefix arrived just after an unrelated prompt started; ``WaitingPolicy.outranks``);
        True when it did. The step (paused between layers with ``fraction_done`` of its work done, by
        layers or by time, at most ``REPLAN_MAX_FRACTION_DONE``) must hold only the first chunks of fresh prompts of one class, none of them put back before: its requests
        release their blocks (the layers it ran are recomputed later, the cached prefix they matched
        stays in the tree) and wait again at the front of their class, ranked with the rest; the
        caller drops the paused step. A request is put back at most once, so none waits for ever."""
        if fraction_done > REPLAN_MAX_FRACTION_DONE or not plan.scheduled:
            return False
        started = [self.requests[entry.request_id] for entry in plan.scheduled]
        keys = {self.tiers.class_key(r) for r in started}
        if len(keys) != 1 or not all(
            r.status == RequestStatus.RUNNING
            and not r.output_token_ids
            and r.num_preemptions == 0
            and not r.replanned
            and r.group_id is None
            and entry.start_position == r.num_cached_tokens
            for r, entry in zip(started, plan.scheduled)
        ):
            return False
        if not self.waiting.outranks_in(keys.pop(), started, fraction_done):
            return False
        for request in reversed(started):
            self.running.remove(request)
            self.kv.free(request.request_id)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            request.replanned = True
            self.waiting.prepend(request)
        return True

    def step_interrupted(self, plan: SchedulerOutput) -> None:
        """``plan`` was abandoned between layers (``step_control.py``): nothing of it was computed, so
        nothing changes but that the next step may not be cut (worse tiers always make progress).
        Its requests keep their reserved blocks and are planned again."""
        self._last_step_interrupted = True

    def _step_budget(self, now: float) -> StepBudget:
        total = self.config.max_num_batched_tokens
        caps = self.tiers.step_caps(now, total, self.requests.values())
        return StepBudget(total, caps, self.tiers.bounded_tiers, self._extra_token_allowance())

    def _extra_token_allowance(self) -> int | None:
        """Tokens beyond one per running request that keep this step's predicted time within the
        TTFT step target; None without a TTFT target or before the model can predict.

        The prediction counts every running request as one token and one sequence, plus one more
        sequence for a prefill chunk or admission. It is never below one block, so bounded tiers'
        prefills and admissions keep moving even when the decodes alone fill the target.
        """
        target = self._step_time_target()
        if target is None:
            return None
        num_running = len(self.running)
        fit = self.step_time.tokens_within(target, num_running + 1)
        if fit is None:
            return None
        return max(self.kv.block_size, fit - num_running)

    def _step_time_target(self) -> float | None:
        """Seconds a step serving bounded tiers should be predicted to take at most: the configured
        fraction of the tightest TTFT target (``TierTable.step_time_target``), and no more than the
        median of the recent steps that served a first token on their own. A request of the
        protected tier waits for the step in flight, then for its own step; with the first no longer
        than the second, its TTFT under any load stays within about twice its TTFT on an idle
        server, whatever target was configured. None without a TTFT target."""
        target = self.tiers.step_time_target
        if target is None or not self._first_token_step_times:
            return target
        return min(target, statistics.median(self._first_token_step_times))

    def _exclusive_rank(self) -> int | None:
        """The rank of the best tier with a request awaiting its first token within a TTFT target:
        this step may serve only that tier and better ones. None when there is no such request, or
        after ``max_exclusive_steps`` such steps in a row (then a step serves everyone, so a stream
        of arrivals in that tier cannot hold worse tiers off for longer than that)."""
        if self.tiers.best_ttft_rank is None or self._exclusive_streak >= self.config.max_exclusive_steps:
            return None
        ranks = [self.tiers.rank[r.tier] for r in self.requests.values() if self.tiers.awaits_first_token(r)]
        return min(ranks, default=None)

    def _may_be_cut(self, plan: list[ScheduledRequest]) -> bool:
        """Whether ``plan`` may be abandoned between layers for an arrival (``step_control.py``).

        Never two steps in a row (the running requests always make progress), nor a step where a
        request shares blocks the step computes (it cannot be redone without them). For a tier with a
        TTFT target, any step that computes no first token it protects.
        """
        if not plan or self._last_step_interrupted or self._shared_sources:
            return False
        return self.tiers.best_ttft_rank is not None and not self._plans_first_token(plan)

    def may_pause(self, plan: list[ScheduledRequest]) -> bool:
        """Whether ``plan`` may be paused between layers for arrivals with a short prefill
        (``short_prefill_interrupt``; ``schedule_beside``): any step but one that finishes a short
        prefill itself, whose first token would wait as long as the arrival's saves, or one that
        computes a first token a tier's TTFT target protects (the arrivals' pass knows no tiers)."""
        limit = self.config.short_prefill_interrupt
        return (
            limit > 0
            and bool(plan)
            and not any(
                entry.sample and not entry.output_token_ids and len(entry.token_ids) <= limit
                for entry in plan
            )
            and not self._plans_first_token(plan)
        )

    def _plans_first_token(self, plan: list[ScheduledRequest]) -> bool:
        """Whether ``plan`` computes tokens of a request awaiting its first token within a TTFT target."""
        return any(self.tiers.awaits_first_token(self.requests[entry.request_id]) for entry in plan)

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
            wanted = request.num_tokens - request.num_computed_tokens
            num_new = budget.grant(request.tier, wanted, running=True)
            if num_new == 0:
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = self._lowest_ranked_running()
                self._preempt(victim)
                num_preempted += 1
                if victim is request:
                    break
            else:
                plan.append(self._plan_entry(request, num_new))
                budget.take(request.tier, num_new, running=True)
        return num_preempted

    def _lowest_ranked_running(self, worse_than: ClassKey | None = None) -> Request:
        """The running request to preempt first: the worst class, then the most recently admitted.

        With ``worse_than``, only requests of a strictly worse class qualify (KeyError if none does).
        """
        candidates = [
            (self.tiers.class_key(r), i)
            for i, r in enumerate(self.running)
            if worse_than is None or self.tiers.class_key(r) > worse_than
        ]
        if not candidates:
            raise KeyError("no running request of a worse class")
        return self.running[max(candidates)[1]]

    def _make_room_for(self, key: ClassKey) -> bool:
        """Preempt one running request of a class worse than ``key``; False when there is none."""
        try:
            victim = self._lowest_ranked_running(worse_than=key)
        except KeyError:
            return False
        self._preempt(victim)
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
            leader = self._sibling_leader(request)
            if leader is not None and not self._leader_prompt_ready(leader, request, plan):
                continue  # wait until the leader's step computes the shared prompt blocks
            source_id, source_tokens = "", 0
            if leader is None and self._prefix_in_flight(key, request):
                source_id, source_tokens = self.kv.prefix_computed_by(
                    request, self._planned_prefills(key, plan)
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
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        plan.append(self._plan_entry(request, request.num_tokens - computed if num_new is None else num_new))

    def _admission_cap(self) -> int | None:
        """How many waiting requests the step being planned may admit: None (as many as the budget
        holds) under ``admission="fill"``, else what keeps their mean time to first token least
        (``core/admission.py``), from what the running requests bring to the step and the prompt
        work of the oldest ``ADMISSION_SAMPLE`` waiting requests beyond their cached prefixes."""
        num_waiting = self.num_waiting
        if self.config.admission != "ttft" or num_waiting == 0:
            return None
        running_tokens = sum(r.num_tokens - r.num_computed_tokens for r in self.running)
        waiting = (r for r in self.requests.values() if r.status != RequestStatus.RUNNING)
        sample = list(itertools.islice(waiting, ADMISSION_SAMPLE))
        mean_new_tokens = statistics.fmean(r.num_tokens - self.kv.peek_prefix_tokens(r) for r in sample)
        return ttft_admission_cap(
            self.step_time,
            min(running_tokens, self.config.max_num_batched_tokens),
            len(self.running),
            num_waiting,
            mean_new_tokens,
        )

    def _tier_is_full(self, tier_name: str) -> bool:
        limit = self.tiers.tiers[tier_name].max_running
        return limit is not None and sum(r.tier == tier_name for r in self.running) >= limit

    def _expire_deadlines(self, now: float) -> None:
        """End every request whose deadline has passed with ``timeout``, freeing its blocks."""
        expired = [r for r in self.requests.values() if r.deadline is not None and now >= r.deadline]
        for request in expired:
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.finish_reason = FinishReason.TIMEOUT
            request.stop_reason = "timeout"
            self._finish(request)
            self._pending_outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=FinishReason.TIMEOUT,
                    stop_reason="timeout",
                    num_cached_tokens=request.num_cached_tokens,
                )
            )
            logger.debug("request %s passed its deadline", request.request_id)

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

    def _leader_prompt_ready(self, leader: Request, request: Request, plan: list[ScheduledRequest]) -> bool:
        """Whether the leader's prompt blocks that ``request`` shares are computed once the step being
        planned has run (a sibling may join the very step that completes them, like any request
        sharing an in-flight prefix: ``KVCacheManager.prefix_computed_by``)."""
        full_prompt_tokens = (request.num_prompt_tokens - 1) // self.kv.block_size * self.kv.block_size
        if full_prompt_tokens == 0:
            return True
        if leader.status != RequestStatus.RUNNING:
            return False
        computed_after = leader.num_computed_tokens
        for entry in plan:
            if entry.request_id == leader.request_id:
                computed_after = entry.end_position
        return computed_after >= full_prompt_tokens

    def _planned_prefills(self, key: ClassKey, plan: list[ScheduledRequest]) -> list[tuple[Request, int]]:
        """The requests of class ``key`` or better with a prompt chunk in ``plan``, each with the number
        of tokens it will have computed once the step has run."""
        planned = []
        for entry in plan:
            request = self.requests[entry.request_id]
            if (
                request.num_computed_tokens < request.num_prompt_tokens
                and self.tiers.class_key(request) <= key
            ):
                planned.append((request, entry.end_position))
        return planned

    def _prefix_in_flight(self, key: ClassKey, request: Request) -> bool:
        """Whether a running request of class ``key`` or better is computing blocks ``request`` shares
        beyond its cached prefix. Requests of worse classes do not count: they may not progress soon."""
        computing = [
            r
            for r in self.running
            if r.num_computed_tokens < r.num_prompt_tokens and self.tiers.class_key(r) <= key
        ]
        return bool(computing) and self.kv.prefix_in_flight(request, computing)

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
        """Take the running request out, release its blocks and queue it to be recomputed."""
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.prepend(request)
        logger.debug("preempted request %s", request.request_id)

    # ------------------------------------------------------------------ applying a step's results

    def record_step_time(self, plan: SchedulerOutput, seconds: float) -> None:
        """Feed the measured wall time of ``plan``'s step (schedule to update) to the step-time model."""
        if not plan.is_empty:
            self.step_time.observe(plan.num_tokens, len(plan.scheduled), seconds)
        if plan.first_token_exclusive:
            self._first_token_step_times.append(seconds)

    def update(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        now = self.clock()
        for entry in plan.scheduled:
            request = self.requests.get(entry.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += len(entry.token_ids)
            self._charge_prompt(request)
            chunk_logprobs = result.prompt_logprobs.get(entry.request_id)
            if chunk_logprobs is not None:
                request.pending_prompt_logprobs.extend(chunk_logprobs)
                request.num_prompt_logprobs_done += len(chunk_logprobs)
            self.kv.cache_computed_blocks(request)
            self.kv.release_out_of_window_blocks(request)
            if not entry.sample:
                continue
            new_tokens, stopped = self._append_tokens(request, result.sampled_token_ids[entry.request_id])
            self._record_tokens(request, len(new_tokens), now)
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

    def _charge_prompt(self, request: Request) -> None:
        """Charge the user for prompt positions computed for the first time (recomputation is free)."""
        computed_prompt = min(request.num_computed_tokens, request.num_prompt_tokens)
        if computed_prompt > request.num_prompt_charged:
            self.waiting.charge(request, computed_prompt - request.num_prompt_charged, 0)
            request.num_prompt_charged = computed_prompt

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
