"""LoRA under service tiers and per-user fairness (``vtc``): requests of two adapters and the base,
in the ``priority``, ``default`` and ``flex`` tiers, from a heavy and a light user, share one device
slot (``max_loras=1``, so adapters wait for the slot while another runs). Every request finishes with
its adapter's greedy output (transformers + PEFT, float32) and the KV cache is whole after."""

from __future__ import annotations

import pytest

from tests.models.lora_adapters import make_adapter
from tests.models.test_lora import greedy, prompts
from tokenmill import LLM
from tokenmill.lora import LoRARequest
from tokenmill.protocol import EngineCoreRequest

NUM_NEW = 10


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):  # type: ignore[no-untyped-def]
    model = tiny_model("llama")
    adapters = [
        make_adapter(model.hf, str(tmp_path_factory.mktemp(f"tier-lora-{i}")), f"t{i}", seed=80 + i, rank=4)
        for i in range(2)
    ]
    return model, adapters


def test_tiers_and_fairness_with_adapters_sharing_one_slot(setup) -> None:  # type: ignore[no-untyped-def]
    model, adapters = setup
    llm = LLM(
        model.path,
        dtype="float32",
        block_size=4,
        num_blocks=200,
        enable_lora=True,
        max_loras=1,
        max_lora_rank=4,
        policy="vtc",
        max_num_seqs=3,
    )
    for i, adapter in enumerate(adapters):
        llm.load_lora(LoRARequest(adapter.name, i + 1, adapter.path))
    batch = prompts(9, seed=31)
    # (adapter index or None, tier, user) per request; the heavy user floods the flex tier first.
    plan: list[tuple[int | None, str, str]] = [
        (0, "flex", "heavy"),
        (0, "flex", "heavy"),
        (1, "flex", "heavy"),
        (None, "flex", "heavy"),
        (1, "default", "light"),
        (0, "default", "light"),
        (1, "priority", "light"),
        (None, "priority", "heavy"),
        (0, "default", "heavy"),
    ]
    core = llm.engine
    for i, (prompt, (choice, tier, user)) in enumerate(zip(batch, plan)):
        core.add_request(
            EngineCoreRequest(
                request_id=f"r{i}",
                prompt_token_ids=prompt,
                sampling_params=greedy(NUM_NEW),
                service_tier=tier,
                user=user,
                lora_name=None if choice is None else adapters[choice].name,
            )
        )
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(plan))}
    finished: set[str] = set()
    swaps_before = llm.kv_stats()["lora_slot_swaps"]
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            assert out.error is None, out.error
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                finished.add(out.request_id)
    assert finished == set(tokens)
    for i, (prompt, (choice, _, _)) in enumerate(zip(batch, plan)):
        want = model.greedy(prompt, NUM_NEW) if choice is None else adapters[choice].greedy(prompt, NUM_NEW)
        assert tokens[f"r{i}"] == want, plan[i]
    assert llm.kv_stats()["lora_slot_swaps"] - swaps_before >= 2  # the one slot changed hands
    assert core.kv_manager.all_free_or_cached()
