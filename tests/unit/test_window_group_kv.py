"""The sliding-window KV group (core/kv/window_group.py) at the scheduler/KV-manager level (no model).

A fake two-layer model: one layer reads the whole sequence through ``block_table`` (the full group),
the other the last ``WINDOW`` positions through ``window_block_table`` (the window group), each from a
cache of its own. It fails on reading a released or never-written slot, so a block released too early,
a table that went wrong, or a prefix resumed from a group that did not hold it changes or breaks the
output.
"""

from __future__ import annotations

import msgspec

from tests.unit.test_scheduler import FakeRunner, Harness, make_request, next_token
from tokenmill.config import SchedulerConfig
from tokenmill.core.kv.manager import RELEASED_BLOCK, cdiv
from tokenmill.core.kv.window_group import WindowGroupKVManager
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.step_io import ModelRunnerOutput, SchedulerOutput
from tokenmill.executor.plan_delta import PlanDecoder, PlanEncoder
from tokenmill.protocol import StepPlanData

WINDOW = 6
BLOCK = 4
MAX_MODEL_LEN = 256
MAX_HELD = cdiv(WINDOW, BLOCK) + 1  # the window plus the block being written


def reference(prompt: list[int], num_new: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_new):
        tokens.append(next_token(tokens + tokens[-WINDOW:]))
    return tokens[len(prompt) :]


class TwoGroupRunner(FakeRunner):
    """A full layer over ``block_table`` and a windowed layer over ``window_block_table``."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.window_slots: dict[int, int] = {}

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        for entry in plan.scheduled:
            window_table = entry.window_block_table
            assert window_table is not None
            for i, token in enumerate(entry.token_ids):
                position = entry.start_position + i
                self.slots[self.slot(entry.block_table, position)] = token
                assert window_table[position // self.block_size] != RELEASED_BLOCK
                self.window_slots[self.slot(window_table, position)] = token
        result = ModelRunnerOutput()
        for entry in plan.scheduled:
            if not entry.sample:
                continue
            window_table = entry.window_block_table
            assert window_table is not None
            end = entry.start_position + len(entry.token_ids)
            full = [self.slots.get(self.slot(entry.block_table, p)) for p in range(end)]
            window = []
            for p in range(max(0, end - WINDOW), end):
                assert window_table[p // self.block_size] != RELEASED_BLOCK, p
                window.append(self.window_slots.get(self.slot(window_table, p)))
            result.sampled_token_ids[entry.request_id] = next_token(full + window)
        return result


def harness(
    num_blocks: int, num_window_blocks: int, prefix_caching: bool, budget: int = 64, max_num_seqs: int = 64
) -> Harness:
    h = Harness(num_blocks, BLOCK, budget=budget, prefix_caching=prefix_caching)
    h.kv = WindowGroupKVManager(num_blocks, BLOCK, prefix_caching, WINDOW, num_window_blocks)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs)
    h.scheduler = Scheduler(config, h.kv, MAX_MODEL_LEN)
    h.runner = TwoGroupRunner(BLOCK)
    return h


def window_held(h: Harness, request_id: str) -> int:
    kv = h.kv
    assert isinstance(kv, WindowGroupKVManager)
    return kv.num_window_held_blocks(request_id)


def assert_window_pool_back(h: Harness) -> None:
    kv = h.kv
    assert isinstance(kv, WindowGroupKVManager)
    window = kv.window
    cached = window.radix.cached_blocks if window.radix is not None else 0
    assert window.pool.num_free == window.num_blocks - cached


def test_long_decode_returns_window_blocks_and_keeps_full_ones() -> None:
    h = harness(num_blocks=40, num_window_blocks=8, prefix_caching=False)
    prompt = [1 + i for i in range(9)]
    h.add("a", prompt, max_tokens=60)
    peak = 0
    while h.scheduler.has_unfinished():
        h.step()
        if h.kv.has_allocation("a"):
            peak = max(peak, window_held(h, "a"))
            kv = h.kv
            assert isinstance(kv, WindowGroupKVManager)
            assert kv.window.pool.num_used == window_held(h, "a")  # only its window is in use
            request = h.scheduler.requests["a"]
            assert kv.num_held_blocks("a") == cdiv(request.num_computed_tokens, BLOCK)  # full keeps all
    assert peak <= MAX_HELD
    assert cdiv(len(prompt) + 60, BLOCK) > 8  # more than the window pool: it had to release
    assert h.outputs["a"] == reference(prompt, 60)
    h.assert_all_blocks_back()
    assert_window_pool_back(h)


def test_chunked_concurrent_and_preempted_requests_match_the_reference() -> None:
    """Budget 5 chunks the prompts; 10 window blocks for four requests force preemptions there (the
    full pool has room for all), and the preempted ones are recomputed from scratch."""
    h = harness(num_blocks=64, num_window_blocks=10, prefix_caching=False, budget=5)
    prompts = {f"r{i}": [3 + (7 * i + j) % 50 for j in range(n)] for i, n in enumerate((2, 13, 25, 7))}
    for request_id, prompt in prompts.items():
        h.add(request_id, prompt, max_tokens=30)
    h.run()
    assert sum(p.num_preempted for p in h.plans) > 0
    for request_id, prompt in prompts.items():
        assert h.outputs[request_id] == reference(prompt, 30), request_id
    assert_window_pool_back(h)


def test_prefix_hit_resumes_where_both_groups_hold_the_prefix() -> None:
    h = harness(num_blocks=48, num_window_blocks=16, prefix_caching=True)
    prompt = [20 + i for i in range(14)]  # three full blocks reach both trees
    h.add("first", prompt, max_tokens=30)
    h.run()
    assert h.outputs["first"] == reference(prompt, 30)
    kv = h.kv
    assert isinstance(kv, WindowGroupKVManager)
    assert kv.window.radix.cached_blocks == len(prompt) // BLOCK
    assert_window_pool_back(h)

    h.add("second", prompt, max_tokens=30)
    h.run()
    assert h.kv.prefix_hit_tokens == len(prompt) // BLOCK * BLOCK
    assert h.outputs["second"] == reference(prompt, 30)

    # The window group's tree lost the prefix (evicted first): the full group's copy alone is not
    # enough, so the whole prompt is recomputed, and the full group's match is given back.
    kv.window.radix.reset()
    hits_before = kv.prefix_hit_tokens
    h.add("third", prompt, max_tokens=30)
    plan, _ = h.step()
    assert plan.scheduled[0].start_position == 0
    assert kv.prefix_hit_tokens == hits_before
    h.run()
    assert h.outputs["third"] == reference(prompt, 30)
    assert_window_pool_back(h)


def test_n_siblings_share_only_what_both_groups_can_give() -> None:
    h = harness(num_blocks=64, num_window_blocks=24, prefix_caching=False)
    prompt = [30 + i for i in range(23)]
    for index in range(3):
        h.add(f"g-{index}", prompt, max_tokens=12, group_id="g", sibling_index=index)
    h.run()
    for index in range(3):
        assert h.outputs[f"g-{index}"] == reference(prompt, 12)
    assert_window_pool_back(h)


def test_allocation_is_all_or_nothing_across_the_groups() -> None:
    kv = WindowGroupKVManager(16, BLOCK, False, WINDOW, 3)
    request = make_request("a", list(range(1, 21)), 4)
    kv.match_prefix(request)
    assert not kv.allocate_slots(request, 20)  # 5 window blocks needed, 3 in the pool
    assert kv.pool.num_free == 16 and kv.window.pool.num_free == 3
    assert kv.block_table("a") == [] and kv.window.block_table("a") == []
    assert kv.allocate_slots(request, 12)
    assert len(kv.block_table("a")) == 3 and len(kv.window.block_table("a")) == 3
    kv.check_integrity()
    kv.free("a")
    assert kv.all_free_or_cached() and kv.window.pool.num_free == 3


class WireRunner(TwoGroupRunner):
    """Runs each plan as a worker process would get it: encoded, through msgpack, and rebuilt."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.encoder, self.decoder = PlanEncoder(), PlanDecoder()
        self.num_released_seen = 0

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        wire = msgspec.msgpack.encode(self.encoder.encode(plan))
        rebuilt = self.decoder.decode(msgspec.msgpack.decode(wire, type=StepPlanData))
        assert rebuilt.scheduled == plan.scheduled  # window tables included
        for entry in rebuilt.scheduled:
            assert entry.window_block_table is not None
            self.num_released_seen = max(
                self.num_released_seen, entry.window_block_table.count(RELEASED_BLOCK)
            )
        return super().execute(rebuilt)


def test_window_tables_cross_the_wire() -> None:
    h = harness(num_blocks=64, num_window_blocks=12, prefix_caching=True, budget=5)
    runner = WireRunner(BLOCK)
    h.runner = runner
    prompts = {f"r{i}": [3 + (7 * i + j) % 50 for j in range(n)] for i, n in enumerate((2, 13, 25, 7))}
    for request_id, prompt in prompts.items():
        h.add(request_id, prompt, max_tokens=30)
    h.run()
    assert runner.num_released_seen > 2
    for request_id, prompt in prompts.items():
        assert h.outputs[request_id] == reference(prompt, 30), request_id


def test_trim_gives_back_draft_slots_in_both_groups() -> None:
    kv = WindowGroupKVManager(16, BLOCK, False, WINDOW, 8)
    request = make_request("a", list(range(1, 8)), 4)
    kv.match_prefix(request)
    assert kv.allocate_slots(request, 7 + 3)  # 7 tokens and 3 drafts: 3 blocks in each group
    assert len(kv.block_table("a")) == 3 and len(kv.window.block_table("a")) == 3
    assert kv.trim_slots(request, 7) == 2  # drafts rejected: the third block goes, in both groups
    assert len(kv.block_table("a")) == 2 and len(kv.window.block_table("a")) == 2
    assert kv.pool.num_free == 14 and kv.window.pool.num_free == 6
    kv.check_integrity()
