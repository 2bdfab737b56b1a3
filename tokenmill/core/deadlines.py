"""Deadlines: requests past their ``deadline`` end with ``timeout``.

Contract: at the start of each ``Scheduler.schedule`` every request whose deadline has passed on
the scheduler's clock is finished with reason ``timeout`` and its blocks are freed, wherever it is
(running or waiting); the client learns it from an output with no new tokens sent with the next
``update``. Token ids only; no torch.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenmill.core.request import Request
from tokenmill.protocol import EngineCoreOutput, FinishReason


def past_deadline(requests: Iterable[Request], now: float) -> list[Request]:
    """The ``requests`` whose deadline is at or before ``now``."""
    return [r for r in requests if r.deadline is not None and now >= r.deadline]


def mark_timed_out(request: Request) -> EngineCoreOutput:
    """Set ``request``'s finish reason to ``timeout``; the output that tells its client."""
    request.finish_reason = FinishReason.TIMEOUT
    request.stop_reason = "timeout"
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=[],
        finish_reason=FinishReason.TIMEOUT,
        stop_reason="timeout",
        num_cached_tokens=request.num_cached_tokens,
    )
