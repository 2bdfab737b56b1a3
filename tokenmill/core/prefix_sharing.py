"""Sharing prompt blocks that are still being computed: n > 1 siblings and in-flight prefixes.

A waiting request may share KV blocks with a running one before they are all computed: a sibling of
an n > 1 group shares its leader's (sibling 0's) prompt blocks, and any request shares the blocks of
a prefix another request of its class or a better one is computing. Contract: such a request is
admitted only once the blocks it shares are computed by the end of the step being planned (then it
attends to them in that very step, after they are written: ``SchedulerOutput.shared_sources``), and
only requests of class ``key`` or better count as sources, because worse ones may not progress soon.
These helpers answer those questions; the scheduler does the admitting. Token ids only; no torch.
"""

from __future__ import annotations

from tokenmill.core.kv.manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.step_io import ScheduledRequest
from tokenmill.core.tiers import ClassKey, TierTable


def sibling_leader(requests: dict[str, Request], request: Request) -> Request | None:
    """The first sibling of ``request``'s group whose prompt blocks it may share, if any: not for
    the leader itself, a preempted sibling (it matches the prefix cache instead) or another prompt."""
    if request.group_id is None or request.sibling_index == 0 or request.num_preemptions > 0:
        return None
    leader = requests.get(f"{request.group_id}-0")
    if leader is None or leader.prompt_token_ids != request.prompt_token_ids:
        return None
    return leader


def leader_prompt_ready(
    leader: Request, request: Request, plan: list[ScheduledRequest], kv: KVCacheManager
) -> bool:
    """Whether the leader's prompt blocks that ``request`` shares are computed once the step being
    planned (``plan``) has run (a sibling may join the very step that completes them, like any
    request sharing an in-flight prefix: ``KVCacheManager.prefix_computed_by``; with a recurrent-state
    model only once they are computed, ``kv.same_step_sharing``)."""
    full_prompt_tokens = (request.num_prompt_tokens - 1) // kv.block_size * kv.block_size
    if full_prompt_tokens == 0:
        return True
    if leader.status != RequestStatus.RUNNING:
        return False
    computed_after = leader.num_computed_tokens
    if not kv.same_step_sharing:
        return computed_after >= full_prompt_tokens
    for entry in plan:
        if entry.request_id == leader.request_id:
            computed_after = entry.end_position
    return computed_after >= full_prompt_tokens


def planned_prefills(
    requests: dict[str, Request], tiers: TierTable, key: ClassKey, plan: list[ScheduledRequest]
) -> list[tuple[Request, int]]:
    """The requests of class ``key`` or better with a prompt chunk in ``plan``, each with the number
    of tokens it will have computed once the step has run."""
    planned = []
    for entry in plan:
        request = requests[entry.request_id]
        if request.num_computed_tokens < request.num_prompt_tokens and tiers.class_key(request) <= key:
            planned.append((request, entry.end_position))
    return planned


def prefix_in_flight(
    running: list[Request], tiers: TierTable, kv: KVCacheManager, key: ClassKey, request: Request
) -> bool:
    """Whether a running request of class ``key`` or better is computing blocks ``request`` shares
    beyond its cached prefix."""
    computing = [
        r for r in running if r.num_computed_tokens < r.num_prompt_tokens and tiers.class_key(r) <= key
    ]
    return bool(computing) and kv.prefix_in_flight(request, computing)
