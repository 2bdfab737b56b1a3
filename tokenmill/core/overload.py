"""Overload: refusing requests the waiting queue has no room for, and when to come back.

Contract: ``queue_refusal`` is asked before requests are added (the server answers 429 with its
reason); it checks the whole waiting queue's bound (``max_waiting``) and the tier's own, and leaves
an unknown tier to ``Scheduler.add_request``, which raises ValueError for it. ``retry_after`` says
how long a refused client should wait. Token ids only; no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tokenmill.config import SchedulerConfig
from tokenmill.core.tiers import TieredQueue, TierTable


def queue_refusal(
    config: SchedulerConfig,
    tiers: TierTable,
    waiting: TieredQueue,
    service_tier: str | None,
    num_requests: int,
) -> str | None:
    """Why ``num_requests`` more requests of ``service_tier`` may not wait now, or None if they may."""
    bound = config.max_waiting
    num_waiting = len(waiting)
    if bound is not None and num_waiting + num_requests > bound:
        return f"the server is overloaded: {num_waiting} requests are already waiting (limit {bound}); retry later"
    try:
        tier = tiers.resolve(service_tier)
    except ValueError:
        return None
    tier_bound = tiers.tiers[tier].max_waiting
    tier_waiting = waiting.num_waiting_in(tier)
    if tier_bound is not None and tier_waiting + num_requests > tier_bound:
        return (
            f"the {tier!r} service tier is overloaded: {tier_waiting} requests are already waiting "
            f"(limit {tier_bound}); retry later"
        )
    return None


def retry_after(recent_finishes: Sequence[float], num_waiting: int) -> float:
    """Seconds a refused client should wait: how long the finish rate seen over ``recent_finishes``
    (clock times, oldest first) takes to drain ``num_waiting`` requests, between 1 and 60 seconds
    (1 before two requests have finished)."""
    if len(recent_finishes) < 2 or recent_finishes[-1] <= recent_finishes[0]:
        return 1.0
    rate = (len(recent_finishes) - 1) / (recent_finishes[-1] - recent_finishes[0])
    return float(min(60, max(1, math.ceil(num_waiting / rate))))
