"""The hybrid KV manager without a model: state slots per request, snapshots on radix nodes.

Drives ``HybridKVCacheManager`` as the scheduler does (match, allocate, plan, computed tokens,
publish, free) and checks what a model runner would be told: which slot, which snapshot to resume
from, which checkpoints to take; that lookups are cut back to the deepest snapshot; that snapshots
go when slots run short; and that every slot comes back.
"""

from __future__ import annotations

from tokenmill.core.kv.hybrid import HybridKVCacheManager
from tokenmill.core.request import Request
from tokenmill.core.step_io import ScheduledRequest
from tokenmill.protocol import EngineCoreRequest
from tokenmill.sampling_params import SamplingParams

BS = 4


def request(request_id: str, tokens: list[int]) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    return Request(
        EngineCoreRequest(request_id=request_id, prompt_token_ids=tokens, sampling_params=params), 1024
    )


def plan(kv: HybridKVCacheManager, req: Request, num_new: int) -> ScheduledRequest:
    start = req.num_computed_tokens
    entry = ScheduledRequest(
        request_id=req.request_id,
        token_ids=req.all_token_ids[start : start + num_new],
        start_position=start,
        block_table=kv.block_table(req.request_id),
        sample=False,
        sampling_params=req.sampling_params,
        prompt_token_ids=req.prompt_token_ids,
        output_token_ids=[],
        forbidden_token_ids=[],
        prompt_logprobs_range=None,
        seed=None,
    )
    kv.plan_state(req, entry)
    return entry


def compute(kv: HybridKVCacheManager, req: Request, num_new: int) -> ScheduledRequest:
    """Admit-or-continue ``req`` for ``num_new`` tokens, plan it, and apply the step."""
    assert kv.allocate_slots(req, num_new)
    entry = plan(kv, req, num_new)
    req.num_computed_tokens += num_new
    kv.cache_computed_blocks(req)
    return entry


def make(num_slots: int = 8, reserved: int = 2, interval: int = 8) -> HybridKVCacheManager:
    return HybridKVCacheManager(
        64, BS, True, num_slots, 100, checkpoint_interval=interval, reserved_slots=reserved
    )


def test_checkpoints_at_intervals_and_the_prompt_end_then_a_hit_restores_the_deepest() -> None:
    kv = make()
    first = request("a", list(range(1, 23)))  # 22 tokens: the prompt ends after the block boundary 20
    kv.match_prefix(first)
    entries = [compute(kv, first, 12), compute(kv, first, 10)]
    assert [p for p, _ in entries[0].state_checkpoints] == [8]
    assert [p for p, _ in entries[1].state_checkpoints] == [16, 20]
    assert entries[0].state_source == -1 and entries[0].state_slot >= 0
    kv.free("a")
    assert kv.stats()["state_snapshots"] == 3
    kv.check_integrity()

    second = request("b", list(range(1, 19)) + [99, 98, 97, 96])  # diverges inside block 5 (16..19)
    assert kv.match_prefix(second) == 16  # the cached path reaches 16 tokens; the snapshot is at 16
    assert kv.allocate_slots(second, second.num_tokens - 16)
    second.num_computed_tokens = 16
    entry = plan(kv, second, second.num_tokens - 16)
    assert entry.state_source == kv._snapshots[kv._node_at(second, 16)]
    assert [p for p, _ in entry.state_checkpoints] == [20]  # its own prompt's end
    kv.free("b")
    kv.check_integrity()
    assert kv.all_free_or_cached()


def test_a_match_deeper_than_any_snapshot_is_cut_back() -> None:
    kv = make(interval=400)  # no interval checkpoints: only the prompt end
    first = request("a", list(range(1, 30)))  # 29 tokens: the snapshot at 28
    kv.match_prefix(first)
    compute(kv, first, 29)
    kv.free("a")
    # Same first 24 tokens: the tree holds 6 blocks of them, but no snapshot before 28.
    other = request("b", list(range(1, 25)) + [77, 78, 79, 80, 81])
    assert kv.match_prefix(other) == 0
    kv.free("b")
    kv.check_integrity()


def test_snapshots_give_way_to_running_requests() -> None:
    kv = make(num_slots=3, reserved=2, interval=4)
    first = request("a", list(range(1, 18)))
    kv.match_prefix(first)
    entry = compute(kv, first, 17)
    # One slot is the request's, one is kept for a second running request: one snapshot slot left.
    assert len(entry.state_checkpoints) == 1
    kv.free("a")
    assert kv.stats()["state_snapshots"] == 1
    # Three running requests need all three slots: the snapshot is evicted for the third.
    reqs = [request(f"r{i}", [50 + i] * 9) for i in range(3)]
    for req in reqs:
        kv.match_prefix(req)
        assert kv.allocate_slots(req, 9)
    assert kv.stats()["state_snapshots"] == 0 and kv.states.num_free == 0
    fourth = request("r3", [70] * 9)
    kv.match_prefix(fourth)
    assert not kv.allocate_slots(fourth, 9)  # no slot: not admitted
    for req in [*reqs, fourth]:
        kv.free(req.request_id)
    kv.check_integrity()
    assert kv.states.num_free == 3 and kv.all_free_or_cached()


def test_evicting_a_node_frees_its_snapshot() -> None:
    kv = HybridKVCacheManager(8, BS, True, 6, 100, checkpoint_interval=4, reserved_slots=1)
    first = request("a", list(range(1, 14)))
    kv.match_prefix(first)
    compute(kv, first, 13)
    kv.free("a")
    snapshots = kv.stats()["state_snapshots"]
    assert snapshots > 0
    # A request needing every block evicts the cached path, and its snapshots with it.
    big = request("b", [90] * 31)
    kv.match_prefix(big)
    assert kv.allocate_slots(big, 31)
    assert kv.stats()["state_snapshots"] == 0
    kv.free("b")
    kv.check_integrity()
    assert kv.states.num_used == 0


def test_a_preempted_requests_state_is_kept_when_a_slot_can_be_spared() -> None:
    kv = make(num_slots=8, reserved=2, interval=400)  # no interval checkpoints
    req = request("a", list(range(1, 30)))
    kv.match_prefix(req)
    compute(kv, req, 3 * BS)  # preempted at a block boundary between prompt chunks
    own = kv._state["a"].slot
    kv.free_preempted(req)
    assert kv.num_preempted_states_kept == 1
    node = kv._node_at(req, 3 * BS)
    assert kv._snapshots[node] == own  # its own slot became the boundary's snapshot
    req.num_computed_tokens = 0
    assert kv.match_prefix(req) == 3 * BS  # the recomputation resumes there
    assert kv.allocate_slots(req, req.num_tokens - 3 * BS)
    req.num_computed_tokens = 3 * BS
    assert plan(kv, req, req.num_tokens - 3 * BS).state_source == own
    kv.free("a")
    kv.check_integrity()
    assert kv.all_free_or_cached()


def test_a_preempted_requests_state_is_dropped_off_a_boundary_or_without_room() -> None:
    kv = make(num_slots=3, reserved=3, interval=400)
    off = request("a", list(range(1, 30)))
    kv.match_prefix(off)
    compute(kv, off, 3 * BS + 1)  # not at a block boundary: the state cannot be resumed from
    kv.free_preempted(off)
    tight = request("b", list(range(40, 70)))
    others = [request(f"r{i}", [80 + i] * 9) for i in range(2)]
    for other in others:  # two other running requests: the third slot is reserved for a third
        kv.match_prefix(other)
        assert kv.allocate_slots(other, 9)
    kv.match_prefix(tight)
    compute(kv, tight, 2 * BS)
    kv.free_preempted(tight)
    assert kv.num_preempted_states_kept == 0
    assert kv.stats()["state_snapshots"] == 0
    for other in others:
        kv.free(other.request_id)
    kv.check_integrity()
    assert kv.all_free_or_cached()
