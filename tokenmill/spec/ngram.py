"""Prompt lookup (n-gram) drafting: copy what followed the sequence's tail the last time it occurred.

For ``n`` from ``max_n`` down to ``min_n``, the last ``n`` tokens are searched for earlier in the
sequence (prompt and output); the first ``n`` with a match drafts the tokens that followed its latest
occurrence. One pass finds every ``n`` at once: the earlier occurrences of the last token, narrowed
to those that also match one more token back, ``max_n - 1`` times (the time grows with the sequence's
length once, not once per ``n`` tried: a 32K-token sequence with no match took ~2.7 ms searched ``n``
by ``n``). Copy-heavy work (editing code, quoting a document, repeating a list) drafts long runs
that the target accepts.

Confidence cut: every earlier occurrence of the tail is a vote on what comes next. The drafter's
probability for its ``j``-th draft token is the share of the occurrences agreeing with drafts
``0..j-1`` that also continue with draft ``j``; drafting stops at the first token whose share is
below ``draft_confidence`` (a tail seen once votes once, and is trusted). Numpy over token ids.
"""

from __future__ import annotations

import numpy as np

from tokenmill.spec.proposer import DraftContext

# Earlier occurrences that vote on the drafts (the latest ones); bounds the work on long sequences.
MAX_VOTERS = 64


class NgramProposer:
    """Prompt-lookup drafts; stateless across steps (see the module docstring)."""

    def __init__(self, min_n: int, max_n: int, draft_confidence: float) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.draft_confidence = draft_confidence

    def propose(self, contexts: list[DraftContext]) -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {}
        for context in contexts:
            found = self.propose_one(context.token_ids, context.max_drafts)
            if found:
                drafts[context.request_id] = found
        return drafts

    def drop(self, request_ids: list[str]) -> None:
        """Nothing is kept per request."""

    def propose_one(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Drafts for one sequence (at most ``max_drafts``; empty when the tail occurs nowhere earlier)."""
        length = len(token_ids)
        if max_drafts <= 0 or length <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)  # [length]
        follow = _longest_tail_occurrences(tokens, self.min_n, min(self.max_n, length - 1))
        if follow is None:
            return []
        return self._continuation(tokens, follow[-MAX_VOTERS:], max_drafts)

    def _continuation(self, tokens: np.ndarray, follow: np.ndarray, max_drafts: int) -> list[int]:
        """The drafts after the latest occurrence, cut where the voters' agreement drops below the
        confidence threshold. ``follow`` holds, per occurrence, the index of the token after it."""
        length = tokens.shape[0]
        latest = int(follow[-1])
        drafts: list[int] = []
        voters = follow
        for j in range(min(max_drafts, length - latest)):
            token = tokens[latest + j]
            in_range = voters + j < length
            voters = voters[in_range]
            agreeing = voters[tokens[voters + j] == token]
            if voters.size and agreeing.size / voters.size < self.draft_confidence:
                break
            drafts.append(int(token))
            voters = agreeing
        return drafts


def _longest_tail_occurrences(tokens: np.ndarray, min_n: int, max_n: int) -> np.ndarray | None:
    """For the largest ``n`` in ``[min_n, max_n]`` whose last ``n`` tokens occur earlier with at least
    one token after them (so never the tail itself): the index of the token after each such
    occurrence, ascending. None when no such ``n`` has one."""
    length = tokens.shape[0]
    # [matches] where each occurrence of the last n tokens ends; n = 1 first: the last token's.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    found = ends if min_n <= 1 and ends.size else None
    for n in range(2, max_n + 1):
        ends = ends[ends >= n - 1]
        ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
        if not ends.size:
            break
        if n >= min_n:
            found = ends
    return None if found is None else found + 1
