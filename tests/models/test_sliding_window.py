"""Mistral's sliding-window attention: prompts longer than the window match transformers."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import UNK, TinySpec, save_tiny_model
from tokenmill import LLM, SamplingParams

WINDOW = 6


@pytest.fixture(scope="module")
def windowed_mistral(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    folder = str(tmp_path_factory.mktemp("tiny-mistral-window"))
    spec = TinySpec("mistral", "MistralConfig", {"num_key_value_heads": 2, "sliding_window": WINDOW})
    return folder, save_tiny_model(spec, seed=11, folder=folder)


def test_window_shorter_than_the_prompt_matches_transformers(windowed_mistral) -> None:  # type: ignore[no-untyped-def]
    folder, hf = windowed_mistral
    prompts = [[10 + (7 * i + j) % 140 for j in range(length)] for i, length in enumerate((3, 9, 17, 25))]
    llm = LLM(folder, dtype="float32", num_blocks=64, block_size=4, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        expected = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=UNK,
        )[0, len(prompt) :].tolist()
        assert output.outputs[0].token_ids == expected


def test_window_is_what_makes_the_difference(windowed_mistral) -> None:  # type: ignore[no-untyped-def]
    """The same weights with full attention give different logits past the window: the mask matters."""
    folder, hf = windowed_mistral
    prompt = [10 + j for j in range(20)]
    with torch.no_grad():
        windowed = hf(torch.tensor([prompt])).logits[0, -1]
        hf.config.sliding_window = None
        full = hf(torch.tensor([prompt])).logits[0, -1]
        hf.config.sliding_window = WINDOW
    assert not torch.allclose(windowed, full, atol=1e-3)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_released_blocks_keep_outputs_identical_and_kv_bounded(windowed_mistral, prefix_caching) -> None:  # type: ignore[no-untyped-def]
    """Every Mistral layer is windowed, so blocks behind the window are released mid-generation:
    prompt + output (up to 45 tokens) is far longer than the window, the output still matches
    transformers and no request ever holds more blocks than its window spans."""
    folder, hf = windowed_mistral
    block_size, max_tokens = 4, 30
    prompts = [[10 + (5 * i + j) % 140 for j in range(length)] for i, length in enumerate((4, 11, 15))]
    llm = LLM(
        folder,
        dtype="float32",
        num_blocks=64,
        block_size=block_size,
        max_num_batched_tokens=8,
        enable_prefix_caching=prefix_caching,
    )
    kv = llm.engine.kv_manager
    assert kv.sliding_window == WINDOW
    scheduler = llm.engine.scheduler
    held_per_step: list[int] = []
    step = llm.engine.step

    def recording_step():  # type: ignore[no-untyped-def]
        outputs = step()
        held = [kv.num_held_blocks(r) for r in scheduler.requests if kv.has_allocation(r)]
        held_per_step.append(max(held, default=0))
        return outputs

    llm.engine.step = recording_step  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        expected = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=UNK,
        )[0, len(prompt) :].tolist()
        assert output.outputs[0].token_ids == expected
    # After a step a request's next query sees its last 5 computed positions (plus itself, not yet
    # stored), which span at most 2 blocks of 4. Under a prefix cache releasing waits for the whole
    # prompt (up to 15 tokens: 4 blocks) to reach the tree. Without releasing, the longest sequence
    # (45 tokens) would end holding 11 blocks.
    if prefix_caching:
        assert max(held_per_step) <= 4 and max(held_per_step[-10:]) == 2
    else:
        assert max(held_per_step) == 2
