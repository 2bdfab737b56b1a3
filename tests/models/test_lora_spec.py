"""LoRA under speculative decoding: the drafter proposes without the adapter (n-gram lookup, or a
draft model that is the base model), verification runs every drafted row with its request's adapter,
so greedy outputs are those of transformers + PEFT (``merge_and_unload``) in float32, which are also
the outputs with speculation off (``test_lora.py``), for a batch mixing two adapters and the base."""

from __future__ import annotations

import random

import pytest

from tests.models.lora_adapters import make_adapter
from tokenmill import LLM, SamplingParams
from tokenmill.lora import LoRARequest

NUM_NEW = 16
K = 3


def prompts() -> list[list[int]]:
    """Prompts that repeat a motif, so the n-gram drafter finds matches."""
    rng = random.Random(3)
    motif = [rng.randrange(5, 160) for _ in range(8)]
    other = [rng.randrange(5, 160) for _ in range(13)]
    return [motif * 3, other, motif + motif[:3], other + other, motif * 2, [9, 8, 7]]


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):  # type: ignore[no-untyped-def]
    model = tiny_model("llama")
    adapters = [
        make_adapter(model.hf, str(tmp_path_factory.mktemp(f"spec-lora-{i}")), f"s{i}", seed=60 + i, rank=8)
        for i in range(2)
    ]
    return model, adapters


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_with_mixed_adapters_matches_peft(setup, method: str) -> None:  # type: ignore[no-untyped-def]
    model, adapters = setup
    spec: dict[str, object] = {"method": method, "num_speculative_tokens": K}
    if method == "ngram":
        spec["prompt_lookup_min"] = 1
    else:
        spec["model"] = model.path  # the base model drafts: adapter requests see drafts rejected
    llm = LLM(
        model.path,
        dtype="float32",
        block_size=4,
        num_blocks=256,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        speculative_config=spec,
    )
    batch = prompts()
    choice: list[int | None] = [0, None, 1, 0, 1, None]
    requests = [None if c is None else LoRARequest(adapters[c].name, c + 1, adapters[c].path) for c in choice]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in batch], params, use_tqdm=False, lora_request=requests
    )
    differs = 0
    for prompt, c, output in zip(batch, choice, outputs):
        expected = model.greedy(prompt, NUM_NEW) if c is None else adapters[c].greedy(prompt, NUM_NEW)
        assert output.outputs[0].token_ids == expected, (method, c, len(prompt))
        differs += c is not None and expected != model.greedy(prompt, NUM_NEW)
    assert differs >= 2, "the adapters should change outputs"
    stats = llm.kv_stats()
    assert stats["spec_num_draft_tokens"] > 0, stats
    assert stats["spec_num_accepted_tokens"] > 0, stats
    if method == "draft_model":
        # The base drafter's guesses for adapter requests are partly wrong: verification (with the
        # adapter) rejected some, and the outputs above are still the adapters'.
        assert stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], stats
    assert llm.engine.kv_manager.all_free_or_cached()
