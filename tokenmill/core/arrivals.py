"""Arrivals beside a paused step: which steps may pause for them, and putting a paused step back.

While the model runs a planned step, short prompts may arrive. A step the scheduler marks
``pausable`` can be paused between layers (``step_control.py``) so that the engine core runs an
arrivals' pass (``Scheduler.schedule_beside``) before the paused step goes on. This module holds
that feature's rules:

- ``may_pause``: which steps may be paused, so that pausing never delays a first token more than it
  saves the arrivals;
- ``replannable``: which paused steps are worth putting back entirely (``Scheduler.replan_paused``),
  because the waiting queue's policy now ranks a waiting request before all of the step's
  requests and little of the step is done;
- ``put_back``: releasing such a step's requests to wait again.

Token ids only; no torch.
"""

from __future__ import annotations

from collections.abc import Mapping

from tokenmill.core.kv.manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.step_bounds import StepBounds
from tokenmill.core.step_io import ScheduledRequest, SchedulerOutput
from tokenmill.core.tiers import ClassKey, TieredQueue, TierTable

# A paused step of fresh prompts that has run at most this share of its layers may be put back when
# waiting requests rank above its own (``Scheduler.replan_paused``): little is recomputed.
REPLAN_MAX_FRACTION_DONE = 0.25


def may_pause(
    plan: list[ScheduledRequest],
    short_prefill_interrupt: int,
    bounds: StepBounds,
    requests: Mapping[str, Request],
) -> bool:
    """Whether ``plan`` may be paused between layers for arrivals with a short prefill (at most
    ``short_prefill_interrupt`` tokens; 0 turns pausing off): any step but one that finishes a
    short prefill itself, whose first token would wait as long as the arrival's saves, or one that
    computes a first token a tier's TTFT target protects (the arrivals' pass knows no tiers)."""
    limit = short_prefill_interrupt
    return (
        limit > 0
        and bool(plan)
        and not any(
            entry.sample and not entry.output_token_ids and len(entry.token_ids) <= limit for entry in plan
        )
        and not bounds.plans_first_token(plan, requests)
    )


def replannable(
    plan: SchedulerOutput, fraction_done: float, requests: Mapping[str, Request], tiers: TierTable
) -> tuple[list[Request], ClassKey] | None:
    """The requests of a paused ``plan`` and their one class, when the plan may be put back: at most
    ``REPLAN_MAX_FRACTION_DONE`` of it done, and only the first chunks of fresh prompts of one class,
    none of them put back before (so none waits for ever) nor part of an n > 1 group. None otherwise.
    Whether the waiting queue outranks them is the caller's question."""
    if fraction_done > REPLAN_MAX_FRACTION_DONE or not plan.scheduled:
        return None
    started = [requests[entry.request_id] for entry in plan.scheduled]
    keys = {tiers.class_key(r) for r in started}
    if len(keys) != 1 or not all(
        r.status == RequestStatus.RUNNING
        and not r.output_token_ids
        and r.num_preemptions == 0
        and not r.replanned
        and r.group_id is None
        and entry.start_position == r.num_cached_tokens
        for r, entry in zip(started, plan.scheduled)
    ):
        return None
    return started, keys.pop()


def put_back(
    started: list[Request], running: list[Request], kv: KVCacheManager, waiting: TieredQueue
) -> None:
    """Release the blocks of a put-back step's ``started`` requests and queue them again at the front
    of their class, in their order, marked ``replanned``. The layers the step ran are recomputed
    later; the cached prefix they matched stays in the tree. Unlike a preemption this is not counted."""
    for request in reversed(started):
        running.remove(request)
        kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.replanned = True
        waiting.prepend(request)
