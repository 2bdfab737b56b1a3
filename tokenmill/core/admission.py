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
Pure arithmetic on ints and floats, no torch.
"""

from __future__ import annotations

import math

from tokenmill.core.step_time import StepTimeModel


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
