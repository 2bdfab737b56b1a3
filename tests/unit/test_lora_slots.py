"""LoRA slots and namespaces in the scheduler and the KV manager, with no model (``core/lora_slots.py``)."""

from __future__ import annotations

import pytest

from tests.unit.test_scheduler import Harness, prompt_of, reference
from tokenmill.core.lora_slots import LoRAAdapters, LoRASlotTable


def test_slot_table_gives_free_then_least_recently_used_slots() -> None:
    table = LoRASlotTable(2)
    assert table.fits(7, running=[]) and table.fits(None, running=[7, 8])
    assert table.acquire(7, running=[]) == 0
    assert table.acquire(8, running=[7]) == 1
    assert table.take_loads() == [(0, 7), (1, 8)] and table.take_loads() == []
    assert not table.fits(9, running=[7, 8])  # both slots hold running adapters
    assert table.fits(8, running=[7, 8])  # already in a slot
    assert table.fits(9, running=[8])
    assert table.acquire(9, running=[8]) == 0  # slot 0's adapter runs no more
    assert table.acquire(7, running=[]) == 1  # slot 1 was used least recently
    assert table.take_loads() == [(0, 9), (1, 7)] and table.num_swaps == 4
    assert table.slot_of(None) == -1 and table.slot_of(7) == 1


def test_adapter_names_get_a_new_id_per_load_and_drain() -> None:
    adapters = LoRAAdapters()
    first = adapters.new_load("x", "/a", 1)
    assert first is not None
    adapters.register(first)
    assert adapters.new_load("x", "/a", 1) is None  # the same folder again: nothing to do
    with pytest.raises(ValueError, match="already loaded from '/a'; unload it first"):
        adapters.new_load("x", "/b", 1)
    adapters.unload("x")
    with pytest.raises(ValueError, match=r"LoRA adapter 'x' is not loaded \(loaded: none\)"):
        adapters.lora_id("x")
    assert adapters.drained([first.lora_id]) == []  # a request still uses it
    assert adapters.drained([None]) == [first]
    again = adapters.new_load("x", "/b", 1)
    assert again is not None and again.lora_id != first.lora_id


def test_a_step_never_needs_more_adapters_than_slots() -> None:
    """Eight requests over four adapters and the base with two slots: every plan uses at most two
    adapters, each entry's slot holds its request's adapter, and every output is right."""
    h = Harness(num_blocks=64, budget=16)
    table = LoRASlotTable(2)
    h.scheduler.lora_slots = table
    device_slots: list[int | None] = [None, None]
    adapters = [None, 1, 2, 3, 4, 1, 2, None]
    prompts = {}
    for i, lora_id in enumerate(adapters):
        prompts[f"r{i}"] = prompt_of(5 + i, start=10 * i + 1)
        h.add(f"r{i}", prompts[f"r{i}"], max_tokens=4).lora_id = lora_id
    for _ in range(200):
        if not h.scheduler.has_unfinished():
            break
        plan = h.scheduler.schedule()
        for slot, lora_id in table.take_loads():
            device_slots[slot] = lora_id
        used = {e.lora_slot for e in plan.scheduled if e.lora_slot >= 0}
        assert len(used) <= 2
        for entry in plan.scheduled:
            want = h.scheduler.requests[entry.request_id].lora_id
            assert (entry.lora_slot == -1) if want is None else device_slots[entry.lora_slot] == want
        for output in h.scheduler.update(plan, h.runner.execute(plan)):
            h.outputs[output.request_id].extend(output.new_token_ids)
    assert not h.scheduler.has_unfinished()
    assert all(h.outputs[rid] == reference(prompt, 4) for rid, prompt in prompts.items())
    assert table.num_swaps >= 4
    h.assert_all_blocks_back()


def test_prefix_cache_is_separate_per_adapter_load() -> None:
    """A prompt cached under adapter load 1 serves load 1 only, never load 2 or the base."""
    h = Harness(num_blocks=64, prefix_caching=True)
    prompt = prompt_of(13)
    cached = {}
    for name, lora_id in (("first", 1), ("other", 2), ("base", None), ("again", 1), ("base-again", None)):
        request = h.add(name, prompt, max_tokens=2)
        request.lora_id = lora_id
        h.run()
        cached[name] = request.num_cached_tokens
    assert cached == {"first": 0, "other": 0, "base": 0, "again": 12, "base-again": 12}
