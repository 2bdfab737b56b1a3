"""Releasing KV blocks that fell out of a sliding window, at the scheduler/KV-manager level (no model).

A windowed fake model samples from the last ``WINDOW`` tokens only, read back through the block
table, and fails if it ever touches a released entry. So a block released too early changes or
breaks the output, and one released never shows in the block counts.
"""

from __future__ import annotations

from tests.unit.test_scheduler import FakeRunner, Harness, next_token
from tokenmill.core.kv.manager import RELEASED_BLOCK, KVCacheManager, cdiv
from tokenmill.core.step_io import ModelRunnerOutput, SchedulerOutput

WINDOW = 6
BLOCK = 4


def windowed_reference(prompt: list[int], num_new: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_new):
        tokens.append(next_token(tokens[-WINDOW:]))  # type: ignore[arg-type]
    return tokens[len(prompt) :]


class WindowedRunner(FakeRunner):
    """A fake model whose every layer attends to the last ``WINDOW`` positions."""

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        for entry in plan.scheduled:
            for i, token in enumerate(entry.token_ids):
                position = entry.start_position + i
                assert entry.block_table[position // self.block_size] != RELEASED_BLOCK
                self.slots[self.slot(entry.block_table, position)] = token
        result = ModelRunnerOutput()
        for entry in plan.scheduled:
            if entry.sample:
                end = entry.start_position + len(entry.token_ids)
                window = range(max(0, end - WINDOW), end)
                for position in window:
                    assert entry.block_table[position // self.block_size] != RELEASED_BLOCK, position
                context = [self.slots.get(self.slot(entry.block_table, p)) for p in window]
                result.sampled_token_ids[entry.request_id] = next_token(context)
        return result


def windowed_harness(num_blocks: int, prefix_caching: bool, budget: int = 64) -> Harness:
    h = Harness(num_blocks, BLOCK, budget=budget, prefix_caching=prefix_caching, sliding_window=WINDOW)
    h.runner = WindowedRunner(BLOCK)
    return h


def held_blocks(h: Harness, request_id: str) -> int:
    return sum(1 for b in h.kv.block_table(request_id) if b != RELEASED_BLOCK)


# The most blocks a running request needs: its window plus the block being written, plus one when the
# window straddles a block boundary.
MAX_HELD = cdiv(WINDOW, BLOCK) + 1


def test_long_generation_holds_a_bounded_number_of_blocks() -> None:
    h = windowed_harness(num_blocks=64, prefix_caching=False)
    prompt = [1 + i for i in range(9)]
    h.add("a", prompt, max_tokens=60)
    peak = 0
    while h.scheduler.has_unfinished():
        h.step()
        if h.kv.has_allocation("a"):
            peak = max(peak, held_blocks(h, "a"))
            # Everything the pool has in use is this request's window.
            assert h.kv.pool.num_used == held_blocks(h, "a")
    assert peak <= MAX_HELD
    assert cdiv(len(prompt) + 60, BLOCK) > 3 * MAX_HELD  # without releasing it would hold far more
    assert h.outputs["a"] == windowed_reference(prompt, 60)
    h.assert_all_blocks_back()


def test_chunked_prompts_and_concurrent_requests_release_and_match_reference() -> None:
    h = windowed_harness(num_blocks=40, prefix_caching=False, budget=5)
    prompts = {f"r{i}": [3 + (7 * i + j) % 50 for j in range(n)] for i, n in enumerate((2, 13, 25, 7))}
    for request_id, prompt in prompts.items():
        h.add(request_id, prompt, max_tokens=30)
    h.run()
    for request_id, prompt in prompts.items():
        assert h.outputs[request_id] == windowed_reference(prompt, 30), request_id


def test_pool_smaller_than_the_whole_sequences_still_serves_everyone() -> None:
    """Three 48-token sequences need 36 blocks without releasing; 12 blocks suffice with it."""
    h = windowed_harness(num_blocks=12, prefix_caching=False)
    prompts = {f"r{i}": [5 + i + j for j in range(8)] for i in range(3)}
    for request_id, prompt in prompts.items():
        h.add(request_id, prompt, max_tokens=40)
    h.run()
    assert sum(p.num_preempted for p in h.plans) == 0
    for request_id, prompt in prompts.items():
        assert h.outputs[request_id] == windowed_reference(prompt, 40)


def test_with_prefix_cache_prompt_blocks_stay_cached_and_released_ones_become_evictable() -> None:
    h = windowed_harness(num_blocks=48, prefix_caching=True)
    prompt = [20 + i for i in range(14)]  # three full blocks reach the tree
    h.add("first", prompt, max_tokens=40)
    while h.scheduler.has_unfinished():
        h.step()
        if h.kv.has_allocation("first"):
            assert held_blocks(h, "first") <= MAX_HELD + cdiv(len(prompt), BLOCK)
    assert h.outputs["first"] == windowed_reference(prompt, 40)
    # Only the prompt's full blocks were published; the released request published nothing more.
    assert h.kv.radix.cached_blocks == len(prompt) // BLOCK
    assert h.kv.radix.evictable_blocks == h.kv.radix.cached_blocks
    h.assert_all_blocks_back()

    # A second request with the same prompt reuses the cached prefix and still matches the reference.
    h.add("second", prompt, max_tokens=40)
    h.run()
    assert h.scheduler.requests == {}
    assert h.kv.prefix_hit_tokens == len(prompt) // BLOCK * BLOCK
    assert h.outputs["second"] == windowed_reference(prompt, 40)


def test_n_siblings_share_nothing_once_the_leader_released_its_first_blocks() -> None:
    h = windowed_harness(num_blocks=48, prefix_caching=False, budget=64)
    prompt = [30 + i for i in range(23)]
    for index in range(3):
        h.add(f"g-{index}", prompt, max_tokens=12, group_id="g", sibling_index=index)
    h.run()
    for index in range(3):
        assert h.outputs[f"g-{index}"] == windowed_reference(prompt, 12)


def test_nothing_is_released_without_a_window() -> None:
    kv = KVCacheManager(16, BLOCK, enable_prefix_caching=False, sliding_window=None)
    h = Harness(16, BLOCK)
    h.kv = kv
    h.scheduler.kv = kv
    h.add("a", [1 + i for i in range(10)], max_tokens=20)
    while h.scheduler.has_unfinished():
        h.step()
        if kv.has_allocation("a"):
            assert RELEASED_BLOCK not in kv.block_table("a")
    h.assert_all_blocks_back()
