"""Service tiers and priorities: scheduling classes, their queues, limits and latency guard.

A request's scheduling class is ``(tier rank, priority)``: tiers in the configured order (best
first; by default OpenAI's ``priority``, ``default``, ``flex``), then lower ``priority`` values
first within a tier. The scheduler serves classes best first, each class's running requests before
its waiting ones, and preempts the worst class first, so a better class is admitted first and may
take blocks and seats from worse ones; ``flex``, the worst by default, runs on what is left.

Per tier: ``max_running`` seats, a ``step_share`` of each step's token budget, a waiting-queue
bound (``max_waiting``, beyond it the server answers 429) and optional TTFT/TPOT targets.

TTFT targets are protected before they are at risk. A request of the best tier with a TTFT target
that arrives must wait for the step in flight, then for its own prefill. So while any tier has a
TTFT target, the tiers worse than it (``bounded_tiers``) are held, proactively, to prefill chunks
that keep each step's predicted time (``core/step_time.py``, fitted to measured steps) within
``ttft_step_fraction`` of the tightest TTFT target, and within the median time of that tier's recent
first-token steps (so the step in flight when such a request arrives takes no longer than its own
prefill: its TTFT under load stays within about twice its TTFT alone); their running requests still
get one token each
every step, so their decodes never stall on it. And a step in which a request of that tier waits
for its first token serves only that tier and better ones (see ``Scheduler.schedule``), so the
prefill runs as on an idle server. The reactive guard remains: when a request of a tier with a
target is about to miss it (``slo_margin`` of the target has passed without a first token, or an
inter-token gap has reached ``slo_margin`` of the TPOT target, after which the request stays
guarded until it ends), every worse tier is also held to ``slo_guard_share`` of the step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from tokenmill.config import SchedulerConfig, TierConfig
from tokenmill.core.fairness import VirtualTokenCounters
from tokenmill.core.policy import WaitingPolicy
from tokenmill.core.request import Request

# (tier rank, priority): smaller is better.
ClassKey = tuple[int, int]


class TierTable:
    """The configured tiers: how to name, rank and limit them, and which are at risk of an SLO miss."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.tiers: dict[str, TierConfig] = {tier.name: tier for tier in config.tiers}
        self.rank: dict[str, int] = {tier.name: i for i, tier in enumerate(config.tiers)}
        self.names = [tier.name for tier in config.tiers]
        ttft_targets = [(self.rank[t.name], t.ttft_slo) for t in config.tiers if t.ttft_slo is not None]
        # The best tier with a TTFT target; every worse tier's steps are bounded in time for it.
        self.best_ttft_rank: int | None = min(rank for rank, _ in ttft_targets) if ttft_targets else None
        best = self.best_ttft_rank
        self.bounded_tiers = frozenset(
            name for name, rank in self.rank.items() if best is not None and rank > best
        )
        # Seconds a step serving bounded tiers should be predicted to take at most (None: no bound).
        self.step_time_target: float | None = (
            config.ttft_step_fraction * min(slo for _, slo in ttft_targets) if ttft_targets else None
        )

    def resolve(self, name: str | None) -> str:
        """The tier a requested ``service_tier`` runs in: ``SchedulerConfig.resolve_tier``."""
        if name is not None and name in self.tiers:  # the common case, without building the error's list
            return name
        return self.config.resolve_tier(name)

    def class_key(self, request: Request) -> ClassKey:
        return (self.rank[request.tier], request.priority)

    def step_caps(self, now: float, budget: int, requests: Iterable[Request]) -> dict[str, int]:
        """Tokens each tier may use this step: its share, cut to the guard share below a tier at risk."""
        caps = {name: max(1, int(tier.step_share * budget)) for name, tier in self.tiers.items()}
        at_risk = [self.rank[r.tier] for r in requests if self.at_risk(r, now)]
        if at_risk:
            best = min(at_risk)
            guard = max(1, int(self.config.slo_guard_share * budget))
            for name, rank in self.rank.items():
                if rank > best:
                    caps[name] = min(caps[name], guard)
        return caps

    def awaits_first_token(self, request: Request) -> bool:
        """Whether ``request`` belongs to a tier with a TTFT target and has no output token yet."""
        return self.tiers[request.tier].ttft_slo is not None and request.num_output_tokens == 0

    def at_risk(self, request: Request, now: float) -> bool:
        """Whether ``request`` is about to miss its tier's TTFT or TPOT target.

        This guard reacts to measured gaps, so the gap that trips it may itself exceed the target;
        the later ones are what it protects (the proactive TTFT bound acts before, see above).
        """
        tier = self.tiers[request.tier]
        margin = self.config.slo_margin
        waiting_for_first = request.first_token_time is None
        if (
            tier.ttft_slo is not None
            and waiting_for_first
            and now - request.arrival_time >= margin * tier.ttft_slo
        ):
            return True
        gap = request.last_token_interval
        if tier.tpot_slo is not None and gap is not None and gap >= margin * tier.tpot_slo:
            # Sticky: releasing the guard as soon as the gap shrinks would let the next large step
            # of a worse tier open it again, so a request that needed it keeps it until it ends.
            request.tpot_guarded = True
        return request.tpot_guarded


class StepBudget:
    """One step's token budget: a total, what each tier may still take of it, and the time bound.

    ``extra_left`` (None: no bound) is how many tokens the step may still hold beyond one token per
    running request (those are counted in the step-time prediction it comes from): every tier's
    extra tokens use it up, and the ``bounded`` tiers may not go past it. So a running request of a
    bounded tier always gets its one token (a decode never stalls on the bound) and only prefill
    chunks and admissions shrink.
    """

    def __init__(
        self,
        total: int,
        tier_caps: dict[str, int],
        bounded: frozenset[str] = frozenset(),
        extra_left: int | None = None,
    ) -> None:
        self.total_left = total
        self.tier_left = dict(tier_caps)
        self.bounded = bounded
        self.extra_left = extra_left

    def grant(self, tier: str, wanted: int, running: bool = False) -> int:
        """How many of ``wanted`` tokens a request of ``tier`` may compute now (0: none);
        ``running`` says the request was running before this step (its first token is counted)."""
        granted = min(wanted, self.total_left, self.tier_left[tier])
        if self.extra_left is not None and tier in self.bounded:
            granted = min(granted, int(running) + max(0, self.extra_left))
        return max(0, granted)

    def exhausted(self, tier: str) -> bool:
        """Whether a request of ``tier`` that was not running may not compute a single token now."""
        return self.grant(tier, 1) == 0

    def take(self, tier: str, num_tokens: int, running: bool = False) -> None:
        self.total_left -= num_tokens
        self.tier_left[tier] -= num_tokens
        if self.extra_left is not None:
            self.extra_left -= max(0, num_tokens - int(running))


class TieredQueue(WaitingPolicy):
    """The waiting queue: one inner policy queue (fcfs, lpm or vtc) per scheduling class.

    ``ordered`` walks the classes best first; ``ordered_in`` one class. Users' fair-share counters
    (when the inner policy is ``vtc``) are shared by all classes and charged through ``charge``.
    """

    name = "tiered"

    def __init__(
        self,
        table: TierTable,
        make_inner: Callable[[], WaitingPolicy],
        counters: VirtualTokenCounters | None = None,
    ) -> None:
        self.table = table
        self.counters = counters
        self._make_inner = make_inner
        self._classes: dict[ClassKey, WaitingPolicy] = {}
        self._waiting_by_tier = dict.fromkeys(table.names, 0)

    def _queue_for(self, request: Request) -> WaitingPolicy:
        key = self.table.class_key(request)
        queue = self._classes.get(key)
        if queue is None:
            queue = self._classes[key] = self._make_inner()
        return queue

    def add(self, request: Request) -> None:
        self._queue_for(request).add(request)
        self._waiting_by_tier[request.tier] += 1

    def prepend(self, request: Request) -> None:
        self._queue_for(request).prepend(request)
        self._waiting_by_tier[request.tier] += 1

    def remove(self, request: Request) -> None:
        key = self.table.class_key(request)
        queue = self._classes[key]
        queue.remove(request)
        if len(queue) == 0:
            del self._classes[key]
        self._waiting_by_tier[request.tier] -= 1

    def class_keys(self) -> list[ClassKey]:
        """The classes with waiting requests, best first."""
        return sorted(self._classes)

    def ordered_in(self, key: ClassKey) -> Iterator[Request]:
        queue = self._classes.get(key)
        return queue.ordered() if queue is not None else iter(())

    def outranks_in(self, key: ClassKey, started: list[Request], fraction_done: float) -> bool:
        """Whether a waiting request of class ``key`` should go before ``started`` (requests of that
        class whose first step ran ``fraction_done`` of its layers; ``WaitingPolicy.outranks``)."""
        queue = self._classes.get(key)
        return queue is not None and queue.outranks(started, fraction_done)

    def ordered(self) -> Iterator[Request]:
        for key in self.class_keys():
            yield from self.ordered_in(key)

    def num_waiting_in(self, tier: str) -> int:
        return self._waiting_by_tier[tier]

    def waiting_by_tier(self) -> dict[str, int]:
        return dict(self._waiting_by_tier)

    def charge(self, request: Request, num_input_tokens: int, num_output_tokens: int) -> None:
        """Account service ``request`` just received to its user (a no-op without fairness)."""
        if self.counters is not None and (num_input_tokens or num_output_tokens):
            self.counters.charge(request.user, num_input_tokens, num_output_tokens)

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._classes.values())
