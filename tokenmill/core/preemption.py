"""Preemption: which running request gives its KV blocks back when they run out, and how.

Contract: the victim is always the lowest-ranked running request, the worst scheduling class
(``core/tiers.py``) and then the most recently admitted, so a better class never loses blocks to a
worse one and the oldest work of a class is kept. A preempted request loses its blocks and its
computed tokens, never its output tokens, and waits at the front of its class to be recomputed
(what the prefix cache holds of it is matched again). Token ids only; no torch.
"""

from __future__ import annotations

import logging

from tokenmill.core.kv.manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.tiers import ClassKey, TieredQueue, TierTable

logger = logging.getLogger(__name__)


def lowest_ranked_running(
    running: list[Request], tiers: TierTable, worse_than: ClassKey | None = None
) -> Request:
    """The running request to preempt first: the worst class, then the most recently admitted.

    With ``worse_than``, only requests of a strictly worse class qualify (KeyError if none does).
    """
    candidates = [
        (tiers.class_key(r), i)
        for i, r in enumerate(running)
        if worse_than is None or tiers.class_key(r) > worse_than
    ]
    if not candidates:
        raise KeyError("no running request of a worse class")
    return running[max(candidates)[1]]


def preempt(request: Request, running: list[Request], kv: KVCacheManager, waiting: TieredQueue) -> None:
    """Take the running ``request`` out, release its blocks and queue it to be recomputed."""
    running.remove(request)
    kv.free_preempted(request)
    request.num_computed_tokens = 0
    request.num_preemptions += 1
    request.status = RequestStatus.PREEMPTED
    waiting.prepend(request)
    logger.debug("preempted request %s", request.request_id)
