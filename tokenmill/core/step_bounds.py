"""How long a step may be while a tier has a TTFT target, and which steps may be cut or paused.

While a service tier has a TTFT target (``TierConfig.ttft_target``), three bounds keep its first
tokens coming about as fast as on an idle server:

- **Step budget.** A step's token budget carries each tier's cap (``TierTable.step_caps``) and, for
  the tiers bounded by the target, an allowance of tokens that keeps the step's predicted time
  (``core/step_time.py``) within the step target: the configured share of the tightest TTFT target,
  and no more than the median of the recent steps that served such a first token on their own.
- **Exclusive steps.** A step where a request of that tier awaits its first token serves only that
  tier and better ones, at most ``max_exclusive_steps`` such steps in a row.
- **Cuts.** A step that computes no first token the target protects may be abandoned between
  layers for an arrival (``step_control.py``), never two steps in a row.

``StepBounds`` keeps what these need across steps (the run of exclusive steps, the recent
first-token step times, whether the last step was cut). Token ids only; no torch.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Mapping

from tokenmill.config import SchedulerConfig
from tokenmill.core.request import Request
from tokenmill.core.step_io import ScheduledRequest, SchedulerOutput
from tokenmill.core.step_time import StepTimeModel
from tokenmill.core.tiers import StepBudget, TierTable

# How many recent first-token steps of their own bound the steps of worse tiers (their median).
FIRST_TOKEN_STEPS_KEPT = 16


class StepBounds:
    """The TTFT-driven bounds on the steps one scheduler plans (see the module docstring).

    Contract: ``budget`` is asked once per plan; ``planned`` is told once per ``schedule`` plan,
    after ``may_be_cut``; ``observe`` gets each step's measured time and ``step_interrupted`` each
    abandoned plan. Without a TTFT target the budget is the plain token budget with the tiers' caps,
    no step is exclusive and none may be cut.
    """

    def __init__(self, config: SchedulerConfig, tiers: TierTable) -> None:
        self.config = config
        self.tiers = tiers
        # Consecutive steps that served only a tier awaiting a first token within a TTFT target.
        self.exclusive_streak = 0
        # Measured seconds of the recent such steps (see step_time_target).
        self.first_token_step_times: deque[float] = deque(maxlen=FIRST_TOKEN_STEPS_KEPT)
        # Whether the last planned step was abandoned: the next one is not cut.
        self.last_step_interrupted = False

    def budget(
        self,
        now: float,
        requests: Iterable[Request],
        num_running: int,
        step_time: StepTimeModel,
        block_size: int,
    ) -> StepBudget:
        """The token budget of the step being planned, with the tiers' caps and time allowance."""
        total = self.config.max_num_batched_tokens
        caps = self.tiers.step_caps(now, total, requests)
        allowance = self.extra_token_allowance(num_running, step_time, block_size)
        return StepBudget(total, caps, self.tiers.bounded_tiers, allowance)

    def extra_token_allowance(
        self, num_running: int, step_time: StepTimeModel, block_size: int
    ) -> int | None:
        """Tokens beyond one per running request that keep this step's predicted time within the
        TTFT step target; None without a TTFT target or before the model can predict.

        The prediction counts every running request as one token and one sequence, plus one more
        sequence for a prefill chunk or admission. It is never below one block, so bounded tiers'
        prefills and admissions keep moving even when the decodes alone fill the target.
        """
        target = self.step_time_target()
        if target is None:
            return None
        fit = step_time.tokens_within(target, num_running + 1)
        if fit is None:
            return None
        return max(block_size, fit - num_running)

    def step_time_target(self) -> float | None:
        """Seconds a step serving bounded tiers should be predicted to take at most: the configured
        fraction of the tightest TTFT target (``TierTable.step_time_target``), and no more than the
        median of the recent steps that served a first token on their own. A request of the
        protected tier waits for the step in flight, then for its own step; with the first no longer
        than the second, its TTFT under any load stays within about twice its TTFT on an idle
        server, whatever target was configured. None without a TTFT target."""
        target = self.tiers.step_time_target
        if target is None or not self.first_token_step_times:
            return target
        return min(target, statistics.median(self.first_token_step_times))

    def exclusive_rank(self, requests: Iterable[Request]) -> int | None:
        """The rank of the best tier with a request awaiting its first token within a TTFT target:
        this step may serve only that tier and better ones. None when there is no such request, or
        after ``max_exclusive_steps`` such steps in a row (then a step serves everyone, so a stream
        of arrivals in that tier cannot hold worse tiers off for longer than that)."""
        if self.tiers.best_ttft_rank is None or self.exclusive_streak >= self.config.max_exclusive_steps:
            return None
        ranks = [self.tiers.rank[r.tier] for r in requests if self.tiers.awaits_first_token(r)]
        return min(ranks, default=None)

    def plans_first_token(self, plan: list[ScheduledRequest], requests: Mapping[str, Request]) -> bool:
        """Whether ``plan`` computes tokens of a request awaiting its first token within a TTFT target."""
        return any(self.tiers.awaits_first_token(requests[entry.request_id]) for entry in plan)

    def may_be_cut(
        self, plan: list[ScheduledRequest], requests: Mapping[str, Request], shares_blocks: bool
    ) -> bool:
        """Whether ``plan`` may be abandoned between layers for an arrival (``step_control.py``).

        Never two steps in a row (the running requests always make progress), nor a step where a
        request shares blocks the step computes (``shares_blocks``: it cannot be redone without
        them). For a tier with a TTFT target, any step that computes no first token it protects.
        """
        if not plan or self.last_step_interrupted or shares_blocks:
            return False
        return self.tiers.best_ttft_rank is not None and not self.plans_first_token(plan, requests)

    def planned(self, exclusive: bool) -> None:
        """A ``schedule`` plan was made, serving only a first-token tier when ``exclusive``."""
        self.exclusive_streak = self.exclusive_streak + 1 if exclusive else 0
        self.last_step_interrupted = False

    def step_interrupted(self) -> None:
        """The last plan was abandoned between layers: the next one may not be cut."""
        self.last_step_interrupted = True

    def observe(self, plan: SchedulerOutput, seconds: float) -> None:
        """Note the measured time of ``plan``'s step when it served only first tokens."""
        if plan.first_token_exclusive:
            self.first_token_step_times.append(seconds)
