"""How many waiting requests one step admits: all the token budget holds, or as many as keep the
waiting requests' mean time to first token least.

``fill`` admits waiting requests while the step's token budget lasts: the most work per step, what
offline batches want. ``ttft`` sizes each step's admissions from the step-time model
(``core/step_time.py``). A step costs ``o`` seconds for its running requests (decodes, prompt
chunks) and about ``p`` more per admitted request (its prompt tokens beyond the cached prefix and
its sequence). Serving ``n`` waiting requests ``k`` per step, the ``j``-th batch gets its first
tokens after ``j·(o + k·p)`` seconds, so the mean wait is about ``(o + k·p)·(n/k + 1)/2``, least
at ``k = sqrt(o·n/p)``: few admissions per step when prefills are dear next to what the running
requests cost anyway, more when many cheap ones wait. Requests that all arrive together (and
finish together) are thereby spread over steps, which also keeps the next burst smaller.
``step_admission_cap`` and ``arrival_pass_cap`` gather those quantities for a planned step and for
an arrivals' pass beside a paused step. Pure arithmetic on ints and floats, no torch.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable

from tokenmill.config import SchedulerConfig
from tokenmill.core.kv.manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.step_time import StepTimeModel

# How many waiting requests (the oldest) the ``ttft`` admission averages the prompt work of.
ADMISSION_SAMPLE = 32


def ttft_admission_cap(
    model: StepTimeModel,
    running_tokens: int,
    num_running: int,
    num_waiting: int,
    mean_new_tokens: float,
) -> int | None:
    """The number of waiting requests a step should admit to keep their mean time to first token
    least, at least 1 and at most ``num_waiting``; None (no cap) before the model predicts.

    ``running_tokens`` and ``num_running`` are the tokens and sequences the running requests bring
    to the step, ``mean_new_tokens`` the tokens a waiting request brings (its prompt beyond its
    cached prefix, averaged over the waiting requests).
    """
    fit = model.coefficients
    if fit is None or num_waiting <= 0:
        return None
    fixed, per_token, per_seq = fit
    overhead = fixed + per_token * running_tokens + per_seq * num_running  # o
    per_request = per_token * mean_new_tokens + per_seq  # p
    if per_request <= 0.0:
        return None  # admissions look free: nothing to trade
    best = round(math.sqrt(overhead * num_waiting / per_request))
    return max(1, min(num_waiting, best))


def step_admission_cap(
    config: SchedulerConfig,
    step_time: StepTimeModel,
    kv: KVCacheManager,
    requests: Iterable[Request],
    running: list[Request],
    num_waiting: int,
) -> int | None:
    """How many waiting requests the step being planned may admit: None (as many as the budget
    holds) under ``admission="fill"``, else what keeps their mean time to first token least, from
    what the ``running`` requests bring to the step and the prompt work of the oldest
    ``ADMISSION_SAMPLE`` of the not-running ``requests`` beyond their cached prefixes."""
    if config.admission != "ttft" or num_waiting == 0:
        return None
    running_tokens = sum(r.num_tokens - r.num_computed_tokens for r in running)
    waiting = (r for r in requests if r.status != RequestStatus.RUNNING)
    sample = list(itertools.islice(waiting, ADMISSION_SAMPLE))
    mean_new_tokens = statistics.fmean(r.num_tokens - kv.peek_prefix_tokens(r) for r in sample)
    return ttft_admission_cap(
        step_time,
        min(running_tokens, config.max_num_batched_tokens),
        len(running),
        num_waiting,
        mean_new_tokens,
    )


def arrival_pass_cap(
    config: SchedulerConfig, step_time: StepTimeModel, kv: KVCacheManager, requests: Iterable[Request]
) -> int | None:
    """How many short arrivals an arrivals' pass admits (``Scheduler.schedule_beside``): None (all it
    may) unless ``admission="ttft"``, else ``ttft_admission_cap`` over the not-running ``requests``
    whose prompts are short beyond their cached prefixes, with nothing running in the pass."""
    if config.admission != "ttft":
        return None
    limit = config.short_prefill_interrupt
    waiting = (r for r in requests if r.status != RequestStatus.RUNNING)
    short = [n for n in (r.num_tokens - kv.peek_prefix_tokens(r) for r in waiting) if n <= limit]
    if not short:
        return None
    return ttft_admission_cap(step_time, 0, 0, len(short), statistics.fmean(short))
