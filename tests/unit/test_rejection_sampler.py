"""Speculative verification (``sample/rejection.py``) and the n-gram drafter (``spec/ngram.py``).

The rejection sampler must keep the target distribution exactly: over many seeded rows, the first
emitted token is distributed as the processed target ``p`` (chi-square), whether the draft is a point
mass (n-gram) or a drafter distribution ``q``; a second token, given the first draft was accepted, is
distributed as the next row's ``p``. Greedy rows accept exactly while the draft is the argmax.
"""

from __future__ import annotations

import math

import torch

from tokenmill.sample.build import RowSamplingInput, build_sampling_metadata, make_generator
from tokenmill.sample.rejection import verify_drafts
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec.ngram import NgramProposer
from tokenmill.spec.proposer import DraftContext

VOCAB = 12


def rows_for(
    params: SamplingParams, drafts: list[list[int]], seed: int | None = None
) -> list[RowSamplingInput]:
    rows = []
    for i, group in enumerate(drafts):
        generator = None if seed is None else make_generator(seed + i, "cpu")
        for j in range(len(group) + 1):
            rows.append(RowSamplingInput(params, generator, [], list(group[:j]), []))
    return rows


def chi_square_critical(df: int) -> float:
    """The 0.999 quantile of chi-square with ``df`` degrees of freedom (Wilson-Hilferty)."""
    z = 3.0902
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """The statistic over the cells with expected count >= 5, and its degrees of freedom."""
    total = counts.sum().item()
    expected = probs * total
    keep = expected >= 5
    statistic = (((counts[keep] - expected[keep]) ** 2) / expected[keep]).sum().item()
    return statistic, int(keep.sum().item()) - 1


def target_probs(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    scaled = logits / temperature
    kth = scaled.topk(top_k).values[-1]
    scaled = torch.where(scaled < kth, float("-inf"), scaled)
    return scaled.softmax(-1)


def test_greedy_rows_accept_exactly_while_the_draft_is_the_argmax() -> None:
    logits = torch.full((4, VOCAB), -1.0)
    for row, best in enumerate([3, 5, 7, 9]):
        logits[row, best] = 2.0
    params = SamplingParams(temperature=0.0)
    drafts = [[3, 5, 8]]  # the third draft is wrong: 7 comes instead
    verified = verify_drafts(logits, build_sampling_metadata(rows_for(params, drafts), "cpu"), drafts)
    assert verified.token_ids == [[3, 5, 7]]
    all_right = [[3, 5, 7]]
    verified = verify_drafts(logits, build_sampling_metadata(rows_for(params, all_right), "cpu"), all_right)
    assert verified.token_ids == [[3, 5, 7, 9]]  # every draft accepted, then the bonus token


def test_penalised_rows_count_the_drafts_before_them() -> None:
    """Row 1's repetition penalty sees draft 0 as an output: a draft equal to the row's raw argmax that
    the penalty pushes below another token is rejected, exactly as plain decoding would."""
    logits = torch.zeros(2, VOCAB)
    logits[0, 4] = 3.0
    logits[1, 4] = 2.0  # best raw, but 4 was just output: 2.0 / 4 = 0.5
    logits[1, 6] = 1.0
    params = SamplingParams(temperature=0.0, repetition_penalty=4.0)
    drafts = [[4]]
    verified = verify_drafts(logits, build_sampling_metadata(rows_for(params, drafts), "cpu"), drafts)
    assert verified.token_ids == [[4, 6]]


def test_point_mass_drafts_keep_the_target_distribution() -> None:
    torch.manual_seed(0)
    base = torch.randn(2, VOCAB) * 1.5  # [2, vocab]: row 0 before the draft, row 1 after it
    params = SamplingParams(temperature=0.8, top_k=8)
    num_samples = 6000
    draft = int(base[0].argsort()[-2])  # the second most likely token: accepted about p(d) of the time
    drafts = [[draft]] * num_samples
    logits = base.repeat(num_samples, 1)  # [2 * num_samples, vocab]
    metadata = build_sampling_metadata(rows_for(params, drafts, seed=1000), "cpu")
    verified = verify_drafts(logits, metadata, drafts)
    first = torch.tensor([tokens[0] for tokens in verified.token_ids])
    p0 = target_probs(base[0], 0.8, 8)
    statistic, df = chi_square(torch.bincount(first, minlength=VOCAB).double(), p0.double())
    assert statistic < chi_square_critical(df), (statistic, df)
    # Given the draft was accepted, the next token comes from row 1's distribution.
    second = torch.tensor([tokens[1] for tokens in verified.token_ids if tokens[0] == draft])
    assert abs(len(second) / num_samples - p0[draft].item()) < 0.03
    p1 = target_probs(base[1], 0.8, 8)
    statistic, df = chi_square(torch.bincount(second, minlength=VOCAB).double(), p1.double())
    assert statistic < chi_square_critical(df), (statistic, df)


def test_drafter_distributions_keep_the_target_distribution() -> None:
    """A draft model's ``q``: accept with min(1, p/q), else draw from the residual max(0, p - q)."""
    torch.manual_seed(1)
    base = torch.randn(2, VOCAB)
    q = torch.randn(VOCAB).softmax(-1)
    params = SamplingParams(temperature=1.0)
    num_samples = 6000
    draws = torch.multinomial(q, num_samples, replacement=True, generator=torch.Generator().manual_seed(5))
    drafts = [[int(d)] for d in draws]
    draft_probs = torch.stack([q, torch.zeros(VOCAB)]).repeat(num_samples, 1)  # bonus rows unused
    metadata = build_sampling_metadata(rows_for(params, drafts, seed=77), "cpu")
    verified = verify_drafts(base.repeat(num_samples, 1), metadata, drafts, draft_probs)
    first = torch.tensor([tokens[0] for tokens in verified.token_ids])
    statistic, df = chi_square(torch.bincount(first, minlength=VOCAB).double(), base[0].softmax(-1).double())
    assert statistic < chi_square_critical(df), (statistic, df)


def test_seeded_verification_is_reproducible_and_logprobs_are_the_targets() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, VOCAB)
    params = SamplingParams(temperature=1.0, logprobs=2)
    drafts = [[int(logits[0].argmax()), int(logits[1].argmax())]]
    runs = [
        verify_drafts(logits, build_sampling_metadata(rows_for(params, drafts, seed=9), "cpu"), drafts)
        for _ in range(2)
    ]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].logprobs is not None
    raw = torch.log_softmax(logits, -1)
    for row, (token, (ids, values, rank)) in enumerate(zip(runs[0].token_ids[0], runs[0].logprobs[0])):
        assert ids[0] == token
        assert math.isclose(values[0], raw[row, token].item(), rel_tol=1e-5)
        assert rank == int((raw[row] > raw[row, token]).sum()) + 1


def test_ngram_drafts_follow_the_latest_occurrence_of_the_longest_tail() -> None:
    proposer = NgramProposer(min_n=1, max_n=3, draft_confidence=0.0)
    #            0  1  2  3  4  5  6  7  8  9 10 11
    sequence = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7]
    # Tail [6, 7] occurs at 1 and 6 (3-gram [3, 6, 7] nowhere earlier): the latest, at 6, goes on with 2, 3.
    assert proposer.propose_one(sequence, 3) == [2, 3, 6]
    assert proposer.propose_one(sequence, 1) == [2]
    assert proposer.propose_one([1, 2, 3, 4], 3) == []  # the tail occurs nowhere earlier
    contexts = [DraftContext("a", sequence, 2), DraftContext("b", [1, 2, 3], 2)]
    assert proposer.propose(contexts) == {"a": [2, 3]}


def test_ngram_confidence_cuts_where_earlier_occurrences_disagree() -> None:
    # Tail [4] occurred three times before: followed by 5 5 9 / 5 5 8 / 5 6 ... .
    sequence = [4, 5, 5, 9, 4, 5, 5, 8, 4, 5, 6, 0, 4]
    trusting = NgramProposer(min_n=1, max_n=1, draft_confidence=0.0)
    assert trusting.propose_one(sequence, 3) == [5, 6, 0]
    # All three agree on 5; only one of three goes on with 6 (1/3 < 0.5): the draft stops there.
    cautious = NgramProposer(min_n=1, max_n=1, draft_confidence=0.5)
    assert cautious.propose_one(sequence, 3) == [5]
