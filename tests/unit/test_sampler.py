"""Sampler and logits processors: filters, penalties, seeded reproducibility, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import RepetitionPenaltyLogitsProcessor

from tokenmill.sample.build import RowSamplingInput, build_sampling_metadata, make_generator
from tokenmill.sample.logits_processors import (
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens_block,
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p,
    pad_token_ids,
)
from tokenmill.sample.sampler import (
    Sampler,
    compute_prompt_logprobs,
    row_uniforms,
    sample_from_probs,
    skip_draws,
)
from tokenmill.sampling_params import SamplingParams

CPU = torch.device("cpu")


def row(
    params: SamplingParams | None = None,
    generator: torch.Generator | None = None,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    block: list[int] | None = None,
) -> RowSamplingInput:
    return RowSamplingInput(
        params=params or SamplingParams(),
        generator=generator,
        prompt_token_ids=prompt or [],
        output_token_ids=output or [],
        block_ids_for_min_tokens=block or [],
    )


def sample(logits: torch.Tensor, rows: list[RowSamplingInput]) -> torch.Tensor:
    metadata = build_sampling_metadata(rows, CPU)
    return Sampler()(logits.clone(), metadata).sampled_token_ids


def random_logits(num_rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab, generator=generator) * 3.0  # [num_rows, vocab]


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax() -> None:
    logits = random_logits(8, 100)
    sampled = sample(logits, [row(SamplingParams(temperature=0.0)) for _ in range(8)])
    assert torch.equal(sampled, logits.argmax(dim=-1))


def test_greedy_rows_in_mixed_batch_are_argmax() -> None:
    torch.manual_seed(0)
    logits = random_logits(6, 50)
    rows = [row(SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, top_k=3)) for i in range(6)]
    sampled = sample(logits, rows)
    assert torch.equal(sampled[0::2], logits[0::2].argmax(dim=-1))


def test_tiny_temperature_is_treated_as_greedy() -> None:
    logits = random_logits(2, 30)
    metadata = build_sampling_metadata([row(SamplingParams(temperature=1e-7))] * 2, CPU)
    assert metadata.all_greedy
    assert torch.equal(Sampler()(logits.clone(), metadata).sampled_token_ids, logits.argmax(dim=-1))


def test_empty_batch() -> None:
    out = Sampler()(torch.empty(0, 10), build_sampling_metadata([], CPU))
    assert out.sampled_token_ids.shape == (0,)


# ---------------------------------------------------------------- filters never leak


def reference_allowed(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float, slack: float
) -> set[int]:
    """Tokens the filters keep, in float64; positive ``slack`` loosens every bound, negative tightens."""
    vocab = len(logits)
    scaled = torch.tensor(logits, dtype=torch.float64) / temperature
    probs = scaled.softmax(dim=0)
    order = sorted(range(vocab), key=lambda i: -logits[i])
    kept = [i for i in order if probs[i] >= min_p * probs.max() - slack]
    kept = kept[: top_k if top_k > 0 else vocab]
    kept_probs = probs[kept] / probs[kept].sum()
    mass_above = 0.0
    allowed = set()
    for token, prob in zip(kept, kept_probs.tolist(), strict=True):
        if mass_above < top_p + slack:
            allowed.add(token)
        mass_above += prob
    return allowed


distinct_logits = st.lists(st.integers(-40, 40), min_size=2, max_size=24, unique=True).map(
    lambda values: [v / 4.0 for v in values]
)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    logits=distinct_logits,
    temperature=st.floats(0.05, 5.0),
    top_k=st.integers(-1, 30),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
)
def test_filters_never_sample_outside_allowed_set(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    loose = reference_allowed(logits, temperature, top_k, top_p, min_p, slack=1e-4)
    strict = reference_allowed(logits, temperature, top_k, top_p, min_p, slack=-1e-4)

    # The processors themselves: every surely-allowed token survives, nothing beyond the loose set does.
    processed = torch.tensor([logits], dtype=torch.float32)
    processed = apply_temperature(processed, torch.tensor([temperature]))
    processed = apply_min_p(processed, torch.tensor([min_p]))
    processed = apply_top_k_top_p(processed, torch.tensor([top_k]), torch.tensor([top_p]))
    survivors = set(torch.isfinite(processed[0]).nonzero().flatten().tolist())
    assert strict <= survivors <= loose

    # The whole sampler, many draws in one batch.
    torch.manual_seed(0)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    batch = torch.tensor([logits] * 256, dtype=torch.float32)
    sampled = sample(batch, [row(params) for _ in range(256)])
    assert set(sampled.tolist()) <= loose


def test_top_k_top_p_exact_masks() -> None:
    probs = torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]])
    logits = probs.log()
    # top-k 2 keeps the two largest.
    out = apply_top_k_top_p(logits.clone(), torch.tensor([2]), None)
    assert torch.isfinite(out[0]).tolist() == [False, True, False, True, False]
    # top-p 0.75: 0.4 + 0.3 = 0.7 < 0.75, so 0.15 is needed as well.
    out = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.75]))
    assert torch.isfinite(out[0]).tolist() == [False, True, False, True, True]
    # top-p 0.65: 0.4 + 0.3 already reaches it.
    out = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.65]))
    assert torch.isfinite(out[0]).tolist() == [False, True, False, True, False]
    # Kept logits are unchanged.
    assert torch.equal(out[0, [1, 3]], logits[0, [1, 3]])


def test_top_k_top_p_leaves_disabled_rows_untouched() -> None:
    logits = random_logits(4, 64) * 30  # spread wide enough that some probabilities underflow to zero
    out = apply_top_k_top_p(logits.clone(), torch.tensor([-1, 0, 5, -1]), torch.tensor([1.0, 1.0, 1.0, 0.5]))
    assert torch.equal(out[:2], logits[:2])
    assert torch.isfinite(out[2]).sum() == 5
    assert not torch.equal(out[3], logits[3])


def test_top_k_keeps_exactly_k_with_ties() -> None:
    logits = torch.zeros(1, 10)
    out = apply_top_k_top_p(logits, torch.tensor([3]), None)
    assert torch.isfinite(out).sum() == 3


def test_min_p_mask() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.12, 0.08], [0.5, 0.3, 0.12, 0.08]])
    out = apply_min_p(probs.log(), torch.tensor([0.2, 0.0]))
    # 0.2 * 0.5 = 0.1: 0.08 goes, 0.12 stays; the min_p 0 row is untouched.
    assert torch.isfinite(out[0]).tolist() == [True, True, True, False]
    assert torch.equal(out[1], probs[1].log())


# ---------------------------------------------------------------- distribution


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# 99.9th percentile of chi-square with 3 and 1 degrees of freedom.
CHI2_CRITICAL_DF3 = 16.27
CHI2_CRITICAL_DF1 = 10.83


@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(), [0.1, 0.2, 0.3, 0.4]),
        (SamplingParams(temperature=2.0), [math.sqrt(p) for p in (0.1, 0.2, 0.3, 0.4)]),
        (SamplingParams(top_k=2), [0.0, 0.0, 0.3, 0.4]),
        (SamplingParams(top_p=0.65), [0.0, 0.0, 0.3, 0.4]),
        (SamplingParams(min_p=0.6), [0.0, 0.0, 0.3, 0.4]),
    ],
)
def test_sample_distribution_matches_probabilities(params: SamplingParams, expected: list[float]) -> None:
    torch.manual_seed(1234)
    num_draws = 40_000
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log().expand(num_draws, 4).contiguous()
    sampled = sample(logits, [row(params) for _ in range(num_draws)])
    counts = torch.bincount(sampled, minlength=4).double()
    target = torch.tensor(expected, dtype=torch.float64)
    target = target / target.sum()
    support = target > 0
    assert counts[~support].sum() == 0
    critical = CHI2_CRITICAL_DF3 if support.sum() == 4 else CHI2_CRITICAL_DF1
    assert chi_square(counts[support], target[support]) < critical


def test_seeded_rows_sample_the_right_distribution() -> None:
    num_rows = 3000
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    logits = probs.float().log().expand(num_rows, 4).contiguous()
    rows = [row(generator=make_generator(seed, CPU)) for seed in range(num_rows)]
    counts = torch.bincount(sample(logits, rows), minlength=4).double()
    assert chi_square(counts, probs) < CHI2_CRITICAL_DF3


# ---------------------------------------------------------------- seeded reproducibility


def run_seeded(
    seeded_index: int, others: list[SamplingParams], steps: int, default_seed: int, seeded: SamplingParams
) -> list[int]:
    """Sample ``steps`` tokens for a seed-42 row placed at ``seeded_index`` among ``others``."""
    torch.manual_seed(default_seed)
    vocab = 64
    seeded_logits = random_logits(1, vocab, seed=7)[0]
    generator = make_generator(42, CPU)
    tokens = []
    for step in range(steps):
        logits = random_logits(len(others) + 1, vocab, seed=1000 + step + default_seed)
        logits[seeded_index] = seeded_logits
        rows = [row(p) for p in others]
        rows.insert(seeded_index, row(seeded, generator=generator))
        tokens.append(int(sample(logits, rows)[seeded_index]))
    return tokens


def test_seeded_row_is_reproducible_across_batches() -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=42)
    alone = run_seeded(0, [], steps=30, default_seed=0, seeded=seeded)
    others_a = [SamplingParams(), SamplingParams(temperature=0.0)]
    others_b = [
        SamplingParams(top_k=5, min_p=0.1),
        SamplingParams(seed=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=1.7),
    ]
    in_batch_a = run_seeded(2, others_a, steps=30, default_seed=1, seeded=seeded)
    in_batch_b = run_seeded(3, others_b, steps=30, default_seed=2, seeded=seeded)
    assert alone == in_batch_a == in_batch_b
    # The draws really are random: the 30 tokens are not all the same.
    assert len(set(alone)) > 3


def test_the_uniform_of_a_seeded_row_depends_only_on_its_generator() -> None:
    torch.manual_seed(0)
    a = row_uniforms(3, {1: make_generator(5, CPU)}, CPU)
    torch.manual_seed(99)
    b = row_uniforms(5, {4: make_generator(5, CPU)}, CPU)
    assert a.dtype == torch.float64 and a.shape == (3,) and b.shape == (5,)
    assert float(a[1]) == float(b[4])
    assert float(a[1]) == float(torch.rand(1, dtype=torch.float64, generator=make_generator(5, CPU)))
    assert not torch.equal(a[[0, 2]], b[[0, 2]])  # unseeded rows come from the default generator
    # Skipping n draws leaves the generator where n rows of draws leave it.
    drawn, skipped = make_generator(5, CPU), make_generator(5, CPU)
    for _ in range(3):
        row_uniforms(1, {0: drawn}, CPU)
    skip_draws(skipped, 3, CPU)
    assert torch.equal(row_uniforms(1, {0: drawn}, CPU), row_uniforms(1, {0: skipped}, CPU))


def test_inverse_transform_picks_the_token_whose_cumulative_interval_holds_the_draw() -> None:
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25], [2.0, 0.0, 0.0, 0.0, 2.0]])  # row 1 unnormalized
    cases = [(0.0, [1, 0]), (0.2499, [1, 0]), (0.25, [3, 0]), (0.4999, [3, 0]), (0.5, [3, 4]), (0.75, [4, 4])]
    for u, expected in cases:
        tokens = sample_from_probs(probs, torch.tensor([u, u], dtype=torch.float64))
        assert tokens.tolist() == expected, u
    # Zero-probability tokens are never picked, whatever the draw.
    draws = torch.rand(10_000, dtype=torch.float64)
    picked = sample_from_probs(probs[:1].expand(10_000, -1), draws)
    assert set(picked.tolist()) == {1, 3, 4}


# ---------------------------------------------------------------- penalties


def test_penalties_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    prompt = pad_token_ids([[0]], 5, CPU)
    output = pad_token_ids([[1, 3, 3]], 5, CPU)
    out = apply_penalties(
        logits.clone(),
        prompt,
        output,
        presence_penalty=torch.tensor([0.5]),
        frequency_penalty=torch.tensor([0.25]),
        repetition_penalty=torch.tensor([2.0]),
    )
    # Repetition over prompt + output {0, 1, 3}: 2/2, -1*2, 3/2; then frequency 0.25 per
    # occurrence in the output (token 1 once, token 3 twice) and presence 0.5 for tokens 1 and 3.
    expected = torch.tensor([[1.0, -2.0 - 0.25 - 0.5, 0.5, 1.5 - 0.5 - 0.5, 0.0]])
    assert torch.allclose(out, expected)


def test_repetition_penalty_matches_transformers() -> None:
    vocab = 20
    logits = random_logits(3, vocab)
    penalties = [1.3, 0.7, 2.0]
    prompts = [[1, 2, 2, 5], [0], [7, 8, 9, 10, 11, 19]]
    outputs = [[5, 6], [], [3, 3, 3]]
    out = apply_penalties(
        logits.clone(),
        pad_token_ids(prompts, vocab, CPU),
        pad_token_ids(outputs, vocab, CPU),
        presence_penalty=None,
        frequency_penalty=None,
        repetition_penalty=torch.tensor(penalties),
    )
    for i, penalty in enumerate(penalties):
        processor = RepetitionPenaltyLogitsProcessor(penalty=penalty)
        expected = processor(torch.tensor([prompts[i] + outputs[i]]), logits[i : i + 1].clone())
        assert torch.allclose(out[i : i + 1], expected)


def test_frequency_and_presence_match_loop_reference() -> None:
    vocab = 12
    logits = random_logits(3, vocab)
    outputs = [[1, 1, 1, 4], [], [11, 0, 11]]
    presence = [0.3, 1.0, -0.5]
    frequency = [0.2, -1.0, 1.5]
    out = apply_penalties(
        logits.clone(),
        None,
        pad_token_ids(outputs, vocab, CPU),
        torch.tensor(presence),
        torch.tensor(frequency),
        None,
    )
    expected = logits.clone()
    for i, ids in enumerate(outputs):
        for token in set(ids):
            expected[i, token] -= frequency[i] * ids.count(token) + presence[i]
    assert torch.allclose(out, expected)


def test_penalties_through_sampler_change_greedy_choice() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0], [5.0, 4.0, 0.0]])
    rows = [
        row(SamplingParams(temperature=0.0, frequency_penalty=2.0), output=[0]),
        row(SamplingParams(temperature=0.0), output=[0]),
    ]
    assert sample(logits, rows).tolist() == [1, 0]


def test_pad_token_ids() -> None:
    padded = pad_token_ids([[1, 2, 3], [], [4]], 9, CPU)
    assert padded.tolist() == [[1, 2, 3], [9, 9, 9], [4, 9, 9]]
    assert pad_token_ids([[], []], 9, CPU).shape == (2, 0)


# ---------------------------------------------------------------- logit bias, min tokens


def test_logit_bias() -> None:
    logits = torch.zeros(2, 6)
    out = apply_logit_bias(logits.clone(), [{2: 1.5, 4: -3.0}, None])
    expected = torch.zeros(2, 6)
    expected[0, 2], expected[0, 4] = 1.5, -3.0
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        apply_logit_bias(logits.clone(), [{6: 1.0}, None])


def test_logit_bias_through_sampler() -> None:
    logits = random_logits(3, 30)
    rows = [
        row(SamplingParams(temperature=0.0, logit_bias={17: 100.0})),
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=1.0, logit_bias={3: 100.0})),
    ]
    sampled = sample(logits, rows)
    assert sampled[0] == 17
    assert sampled[1] == logits[1].argmax()
    assert sampled[2] == 3


def test_min_tokens_block() -> None:
    logits = torch.tensor([[1.0, 9.0, 2.0], [1.0, 9.0, 2.0]])
    out = apply_min_tokens_block(logits.clone(), {0: [1, 2]})
    assert out[0].tolist() == [1.0, float("-inf"), float("-inf")]
    assert out[1].tolist() == [1.0, 9.0, 2.0]

    torch.manual_seed(0)
    num_rows = 500
    logits = torch.zeros(num_rows, 5)
    logits[:, 4] = 5.0  # the "EOS" token would dominate
    rows = [row(SamplingParams(), block=[4]) for _ in range(num_rows)]
    sampled = sample(logits, rows)
    assert (sampled != 4).all()
    greedy = sample(logits[:1], [row(SamplingParams(temperature=0.0), block=[4])])
    assert greedy[0] != 4


# ---------------------------------------------------------------- logprobs


def test_logprobs_come_from_raw_logits() -> None:
    torch.manual_seed(0)
    vocab = 40
    logits = random_logits(4, vocab)
    rows = [
        row(SamplingParams(temperature=0.0, logprobs=5, logit_bias={0: 50.0})),
        row(SamplingParams(temperature=1.0, logprobs=2, top_k=4)),
        row(SamplingParams(temperature=0.0, repetition_penalty=3.0), output=[int(logits[2].argmax())]),
        row(SamplingParams(temperature=0.7, logprobs=0)),
    ]
    metadata = build_sampling_metadata(rows, CPU)
    assert metadata.max_num_logprobs == 5
    out = Sampler()(logits.clone(), metadata)
    assert out.logprob_token_ids is not None and out.logprobs is not None and out.sampled_rank is not None
    assert out.logprob_token_ids.shape == (4, 6) and out.logprobs.shape == (4, 6)
    assert out.logprobs.dtype == torch.float32 and out.sampled_rank.dtype == torch.int64

    raw = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert sampled[0] == 0  # the bias decided the token...
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    # ...but the reported logprobs are those of the unbiased distribution.
    assert torch.allclose(out.logprobs, raw.gather(1, out.logprob_token_ids))
    top_values, top_ids = raw.topk(5, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top_ids)
    assert (out.logprobs[:, 1:-1] >= out.logprobs[:, 2:]).all()
    order = raw.argsort(dim=-1, descending=True)
    expected_ranks = (order == sampled[:, None]).int().argmax(dim=-1) + 1
    assert torch.equal(out.sampled_rank, expected_ranks)
    # The penalised greedy row picked something other than the raw argmax, so its rank is > 1.
    assert out.sampled_rank[2] > 1


def test_no_logprobs_means_none() -> None:
    out = Sampler()(random_logits(2, 10), build_sampling_metadata([row(), row()], CPU))
    assert out.logprob_token_ids is None and out.logprobs is None and out.sampled_rank is None


def test_logprobs_zero_returns_only_sampled_token() -> None:
    logits = random_logits(2, 10)
    out = Sampler()(logits.clone(), build_sampling_metadata([row(SamplingParams(logprobs=0))] * 2, CPU))
    assert out.logprob_token_ids is not None and out.logprobs is not None
    assert out.logprob_token_ids.shape == (2, 1)
    assert torch.allclose(
        out.logprobs[:, 0], torch.log_softmax(logits, -1).gather(1, out.sampled_token_ids[:, None])[:, 0]
    )


def test_compute_prompt_logprobs() -> None:
    num_tokens, vocab = 7, 25
    logits = random_logits(num_tokens, vocab).to(torch.bfloat16)
    targets = torch.tensor([3, 0, 24, 5, 5, 11, 2])
    ids, values, ranks = compute_prompt_logprobs(logits, targets, num_top=3)
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert ids.shape == values.shape == (num_tokens, 4)
    assert torch.equal(ids[:, 0], targets)
    assert torch.allclose(values[:, 0], raw[torch.arange(num_tokens), targets])
    assert torch.equal(ids[:, 1:], raw.topk(3, dim=-1).indices)
    assert torch.allclose(values, raw.gather(1, ids))
    expected_ranks = torch.tensor([int((raw[t] > raw[t, targets[t]]).sum()) + 1 for t in range(num_tokens)])
    assert torch.equal(ranks, expected_ranks)


# ---------------------------------------------------------------- metadata building


def test_build_metadata_fast_path_is_empty() -> None:
    metadata = build_sampling_metadata([row(), row(SamplingParams(temperature=0.5))], CPU)
    assert metadata.all_random and not metadata.all_greedy
    assert metadata.top_k is None and metadata.top_p is None and metadata.min_p is None
    assert metadata.no_penalties
    assert metadata.prompt_token_ids is None and metadata.output_token_ids is None
    assert metadata.logit_bias is None and metadata.min_tokens_block == {} and metadata.generators == {}
    assert metadata.max_num_logprobs is None


def test_build_metadata_fields() -> None:
    generator = make_generator(1, CPU)
    rows = [
        row(SamplingParams(temperature=0.0, top_k=3, seed=1), generator=make_generator(1, CPU)),
        row(SamplingParams(top_p=0.5, repetition_penalty=1.2, logprobs=3), generator, [1, 2], [3]),
        row(SamplingParams(min_p=0.1, presence_penalty=0.5, logit_bias={1: 2.0}), None, [4], [5, 6], [0]),
        row(SamplingParams(top_k=0, logprobs=1), None, [7], [8]),
    ]
    metadata = build_sampling_metadata(rows, CPU)
    assert not metadata.all_greedy and not metadata.all_random
    assert metadata.temperature.tolist() == [0.0, 1.0, 1.0, 1.0]
    # The greedy row's top_k does not matter and no random row uses top-k.
    assert metadata.top_k is None
    assert metadata.top_p is not None and metadata.top_p.tolist() == [1.0, 0.5, 1.0, 1.0]
    assert metadata.min_p is not None and metadata.min_p.tolist() == pytest.approx([0.0, 0.0, 0.1, 0.0])
    assert metadata.generators == {1: generator}
    assert metadata.repetition_penalty is not None
    assert metadata.repetition_penalty.tolist() == pytest.approx([1.0, 1.2, 1.0, 1.0])
    assert metadata.presence_penalty is not None and metadata.presence_penalty.tolist() == [
        0.0,
        0.0,
        0.5,
        0.0,
    ]
    assert metadata.frequency_penalty is None
    assert metadata.prompt_token_ids == [[], [1, 2], [], []]
    assert metadata.output_token_ids == [[], [3], [5, 6], []]
    assert metadata.logit_bias == [None, None, {1: 2.0}, None]
    assert metadata.min_tokens_block == {2: [0]}
    assert metadata.max_num_logprobs == 3


def test_greedy_on_bfloat16_logits_picks_the_float32_argmax() -> None:
    """The plain-greedy path samples straight from bfloat16 logits; upcasting first gives the same."""
    logits = torch.randn(9, 49152, generator=torch.Generator().manual_seed(3)).bfloat16()
    logits[2, :] = 1.0  # a full tie: the first token
    rows = [row(SamplingParams(temperature=0.0)) for _ in range(9)]
    out = Sampler()(logits.clone(), build_sampling_metadata(rows, torch.device("cpu")))
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(dim=-1))
    assert out.sampled_token_ids[2] == 0
