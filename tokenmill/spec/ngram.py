"""Prompt lookup (n-gram) drafting: copy what followed the sequence's tail the last time it occurred.

For ``n`` from ``max_n`` down to ``min_n``, the last ``n`` tokens are searched for earlier in the
sequence (prompt and output); the first ``n`` with a match drafts the tokens that followed its latest
occurrence. Copy-heavy work (editing code, quoting a document, repeating a list) drafts long runs
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
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            starts = _occurrences(tokens, n)  # [num_matches] start of each earlier occurrence
            if starts.size:
                return self._continuation(tokens, starts[-MAX_VOTERS:] + n, max_drafts)
        return []

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


def _occurrences(tokens: np.ndarray, n: int) -> np.ndarray:
    """Start indices of the earlier occurrences of the last ``n`` tokens that have at least one token
    after them (so never the tail itself), ascending."""
    length = tokens.shape[0]
    tail = tokens[length - n :]
    windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # [length - n, n]
    return np.flatnonzero((windows == tail).all(axis=1))
