"""The n-gram proposer against the rule its module states, written out in plain Python: for ``n`` from
``max_n`` down to ``min_n``, the earlier occurrences of the last ``n`` tokens (each with a token
after it); the first ``n`` with any drafts what followed the latest one, cut where the occurrences'
agreement falls below ``draft_confidence``."""

from __future__ import annotations

import random

import pytest

from tokenmill.spec.ngram import MAX_VOTERS, NgramProposer


def reference_drafts(
    tokens: list[int], min_n: int, max_n: int, confidence: float, max_drafts: int
) -> list[int]:
    length = len(tokens)
    if max_drafts <= 0 or length <= min_n:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = tokens[length - n :]
        starts = [s for s in range(length - n) if tokens[s : s + n] == tail]
        if not starts:
            continue
        voters = [s + n for s in starts][-MAX_VOTERS:]
        latest = voters[-1]
        drafts: list[int] = []
        for j in range(min(max_drafts, length - latest)):
            token = tokens[latest + j]
            voters = [v for v in voters if v + j < length]
            agreeing = [v for v in voters if tokens[v + j] == token]
            if voters and len(agreeing) / len(voters) < confidence:
                break
            drafts.append(token)
            voters = agreeing
        return drafts
    return []


@pytest.mark.parametrize(("min_n", "max_n"), [(1, 1), (1, 3), (2, 5), (3, 3), (2, 8)])
def test_drafts_follow_the_stated_rule_on_random_sequences(min_n: int, max_n: int) -> None:
    rng = random.Random(min_n * 100 + max_n)
    checked_with_drafts = 0
    for trial in range(400):
        alphabet = rng.choice([2, 3, 5, 20])
        length = rng.randint(1, 120)
        tokens = [rng.randrange(alphabet) for _ in range(length)]
        if trial % 4 == 0 and length > 10:  # a copied stretch, as in copy-heavy work
            cut = rng.randint(1, length - 1)
            tokens = tokens + tokens[rng.randrange(cut) : cut]
        confidence = rng.choice([0.0, 0.3, 0.5, 1.0])
        max_drafts = rng.randint(0, 8)
        proposer = NgramProposer(min_n=min_n, max_n=max_n, draft_confidence=confidence)
        expected = reference_drafts(tokens, min_n, max_n, confidence, max_drafts)
        assert proposer.propose_one(tokens, max_drafts) == expected, (tokens, confidence, max_drafts)
        checked_with_drafts += bool(expected)
    assert checked_with_drafts > 100  # the comparison covered drafting, not only misses


def test_only_the_latest_occurrences_vote() -> None:
    # The tail [7] occurs 100 times going on with 1, then MAX_VOTERS times going on with 2. Only the
    # latest MAX_VOTERS vote, so they agree on 2 even at confidence 1.0 (had all voted, 64 of 164
    # would agree: no draft).
    tokens = [7, 1] * 100 + [7, 2] * MAX_VOTERS + [7]
    proposer = NgramProposer(min_n=1, max_n=1, draft_confidence=1.0)
    assert proposer.propose_one(tokens, 1) == [2] == reference_drafts(tokens, 1, 1, 1.0, 1)
