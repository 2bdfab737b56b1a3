"""Logprobs a trainer can trust: which distribution they describe, and the exact float32 mode."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TinyModel
from tests.unit.rl_helpers import PROMPT, fixture_weights_a  # noqa: F401
from tokenmill import LLM, SamplingParams
from tokenmill.sample.build import RowSamplingInput, build_sampling_metadata, make_generator
from tokenmill.sample.sampler import PROCESSED_FLOOR, Sampler

CPU = torch.device("cpu")


def _row(params: SamplingParams, seed: int | None = None) -> RowSamplingInput:
    generator = make_generator(seed, CPU) if seed is not None else None
    return RowSamplingInput(
        params=params,
        generator=generator,
        prompt_token_ids=[3, 4],
        output_token_ids=[5, 5],
        block_ids_for_min_tokens=[],
    )


def test_processed_logprobs_are_those_of_the_distribution_sampled_from() -> None:
    vocab = 40
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)) * 3.0  # [3, vocab]
    params = [
        SamplingParams(temperature=0.0, logprobs=2, logit_bias={7: 50.0}),
        SamplingParams(temperature=0.5, top_k=3, logprobs=2),
        SamplingParams(temperature=1.3, logprobs=2, repetition_penalty=1.5),
    ]
    metadata = build_sampling_metadata([_row(p, seed=i) for i, p in enumerate(params)], CPU)
    out = Sampler("processed_logprobs")(logits.clone(), metadata)
    assert out.logprob_token_ids is not None and out.logprobs is not None
    tokens = out.sampled_token_ids.tolist()
    # Each row's distribution by hand.
    greedy = logits[0].clone()
    greedy[7] += 50.0
    top3 = logits[1] / 0.5
    top3[top3 < top3.topk(3).values[-1]] = float("-inf")
    penalized = logits[2].clone()
    for token in (3, 4, 5):
        value = penalized[token]
        penalized[token] = value / 1.5 if value > 0 else value * 1.5
    expected = [torch.log_softmax(row, dim=-1) for row in (greedy, top3, penalized / 1.3)]
    assert tokens[0] == 7
    for i, reference in enumerate(expected):
        assert out.logprob_token_ids[i, 0].item() == tokens[i]
        chosen = reference[tokens[i]].item()
        assert out.logprobs[i, 0].item() == pytest.approx(chosen, abs=1e-5)
        top = reference.clamp_min(PROCESSED_FLOOR).topk(2).values
        assert out.logprobs[i, 1:].tolist() == pytest.approx(top.tolist(), abs=1e-5)
    # Row 1 could draw only its top 3: the rest sit at the floor, not at -inf.
    assert torch.isfinite(out.logprobs).all()
    raw = Sampler()(
        logits.clone(), build_sampling_metadata([_row(p, seed=i) for i, p in enumerate(params)], CPU)
    )
    assert raw.logprobs is not None
    assert raw.logprobs[1, 0].item() == pytest.approx(
        torch.log_softmax(logits[1], -1)[tokens[1]].item(), abs=1e-5
    )


def test_exact_mode_equals_a_float32_transformers_recompute(weights_a: TinyModel) -> None:
    """Sampled at temperature 1 with the exact mode (``dtype`` left at auto, which would be
    bfloat16 on this CPU): every sampled token's logprob is transformers' float32 one within 1e-4."""
    llm = LLM(weights_a.path, rl_exact_logprobs=True, num_blocks=64, block_size=4, seed=0)
    assert llm.engine.executor.runner.dtype == torch.float32  # type: ignore[attr-defined]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True, logprobs=0)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    sequence = PROMPT + out.token_ids
    reference = weights_a.log_softmax(sequence)  # [len, vocab]
    assert out.logprobs is not None
    worst = 0.0
    for i, (token, position) in enumerate(zip(out.token_ids, out.logprobs)):
        expected = reference[len(PROMPT) - 1 + i, token].item()
        worst = max(worst, abs(position[token].logprob - expected))
    assert worst < 1e-4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "bfloat16"}, "rl_exact_logprobs computes in float32; it cannot run with dtype=bfloat16"),
        ({"kv_cache_dtype": "bfloat16"}, "cannot run with kv_cache_dtype=bfloat16"),
        ({"quantization": "int8"}, "cannot run with quantization=int8"),
    ],
)
def test_exact_mode_refuses_what_would_change_the_logprobs(
    weights_a: TinyModel, kwargs: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(weights_a.path, rl_exact_logprobs=True, num_blocks=16, **kwargs)


def test_unknown_logprobs_mode(weights_a: TinyModel) -> None:
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        LLM(weights_a.path, logprobs_mode="sideways", num_blocks=16)
