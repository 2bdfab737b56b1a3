"""Phi-3: fused qkv and gate-up checkpoint tensors load into the Llama-family model."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import UNK, TinySpec, save_tiny_model
from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny_phi3(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    folder = str(tmp_path_factory.mktemp("tiny-phi3"))
    spec = TinySpec("phi3", "Phi3Config", {"num_key_value_heads": 2, "tie_word_embeddings": False})
    return folder, save_tiny_model(spec, seed=21, folder=folder)


def test_phi3_greedy_matches_transformers(tiny_phi3) -> None:  # type: ignore[no-untyped-def]
    folder, hf = tiny_phi3
    assert any("qkv_proj" in name for name in hf.state_dict())  # the checkpoint really is fused
    prompts = [[10 + (5 * i + j) % 140 for j in range(length)] for i, length in enumerate((2, 7, 19))]
    llm = LLM(folder, dtype="float32", num_blocks=64, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        expected = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=UNK,
        )[0, len(prompt) :].tolist()
        assert output.outputs[0].token_ids == expected
