"""Gemma 3: interleaved sliding/global layers, Gemma norms, soft-capping, against transformers."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import UNK, TinySpec, save_tiny_model
from tokenmill import LLM, SamplingParams

WINDOW = 5
# Sliding, sliding, global, sliding: the window (5) is shorter than most prompts, so a wrong mask,
# a wrong per-layer window or a wrong rope base per layer changes the tokens.
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
GEMMA3 = TinySpec(
    "gemma3_text",
    "Gemma3TextConfig",
    {
        "num_hidden_layers": len(LAYER_TYPES),
        "num_key_value_heads": 2,
        "head_dim": 32,
        "query_pre_attn_scalar": 24,
        "sliding_window": WINDOW,
        "layer_types": LAYER_TYPES,
        "rope_theta": 1000.0,
        "rope_local_base_freq": 50.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "final_logit_softcapping": 8.0,
        "tie_word_embeddings": True,
    },
)
PROMPT_LENGTHS = (1, 3, 6, 11, 19, 27)
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    folder = str(tmp_path_factory.mktemp("tiny-gemma3"))
    return folder, save_tiny_model(GEMMA3, seed=31, folder=folder)


def _prompts() -> list[list[int]]:
    return [[10 + (11 * i + 3 * j) % 140 for j in range(n)] for i, n in enumerate(PROMPT_LENGTHS)]


def _hf_greedy(hf, prompt: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=UNK,
    )
    return out[0, len(prompt) :].tolist()


def test_gemma3_greedy_and_logprobs_match_transformers(tiny_gemma3) -> None:  # type: ignore[no-untyped-def]
    folder, hf = tiny_gemma3
    prompts = _prompts()
    llm = LLM(folder, dtype="float32", num_blocks=96, block_size=4, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        expected = _hf_greedy(hf, prompt)
        assert completion.token_ids == expected
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + expected])).logits[0].float()
        reference = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]  # [MAX_TOKENS, vocab]
        ours = torch.tensor([lp[t].logprob for lp, t in zip(completion.logprobs, expected)])
        theirs = reference.gather(1, torch.tensor(expected)[:, None]).squeeze(1)
        assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()


def test_sliding_layers_make_the_difference(tiny_gemma3) -> None:  # type: ignore[no-untyped-def]
    """With every layer global, transformers' logits past the window change: the test above could
    not pass with the window ignored."""
    _, hf = tiny_gemma3
    prompt = [10 + j for j in range(20)]
    with torch.no_grad():
        mixed = hf(torch.tensor([prompt])).logits[0, -1]
        hf.config.layer_types = ["full_attention"] * len(LAYER_TYPES)
        try:
            full = hf(torch.tensor([prompt])).logits[0, -1]
        finally:
            hf.config.layer_types = LAYER_TYPES
    assert not torch.allclose(mixed, full, atol=1e-3)


def test_attention_softcapping_is_refused() -> None:
    import transformers

    from tokenmill.models.gemma3 import Gemma3Args

    config = transformers.Gemma3TextConfig(num_hidden_layers=2, attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        Gemma3Args.from_hf(config)
