"""Speculative verification: keep the draft tokens the target model agrees with, exactly.

A request with ``k`` drafts has ``k + 1`` consecutive logit rows: row ``j`` is the target's output at
the position before draft ``j`` (row 0 at the last real token), row ``k`` the one after the last
draft. Every row goes through the sampler's own pipeline first (logit bias, min-tokens block,
penalties, grammar bitmask; then temperature, min-p, top-k, top-p for random rows), built per row
by the caller (row ``j``'s penalties count the drafts before it), so the target distribution is the
one plain sampling draws from.

- Greedy rows: draft ``j`` is accepted while it is the argmax of row ``j``; the first mismatch emits
  that argmax instead, and when every draft is accepted the argmax of row ``k`` follows (the bonus
  token). The output is token for token what plain greedy decoding produces.
- Random rows: draft ``j`` (proposed with probability ``q(d)``) is accepted with probability
  ``min(1, p(d) / q(d))``; the first rejection emits a token drawn from the normalised residual
  ``max(0, p - q)``; all accepted, the bonus is drawn from row ``k``. Each emitted token is then
  distributed exactly as ``p`` (the standard speculative sampling argument), whatever the drafts
  were. For point-mass drafts (n-gram: ``q(d) = 1``) the same law is realised by drawing each row's
  token as plain sampling does and accepting the draft when it is that token
  (``_verify_point_masses``), which keeps a seeded request's output independent of how many drafts
  each step verified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sample.sampler import (
    gather_logprobs,
    greedy_tokens,
    random_row_probs,
    row_uniforms,
    sample_from_probs,
    shared_processors,
    skip_draws,
)


@dataclass
class VerifiedTokens:
    """Per request (in the order given): the emitted tokens (accepted drafts, then one more), and
    when logprobs were asked, ``(ids, values, rank)`` per emitted token as ``gather_logprobs``
    returns them (raw target distribution, the sampled token first)."""

    token_ids: list[list[int]]
    logprobs: list[list[tuple[list[int], list[float], int]]] | None


def verify_drafts(
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    drafts: list[list[int]],
    draft_probs: torch.Tensor | None = None,
) -> VerifiedTokens:
    """Verify each request's ``drafts`` against its ``len(drafts) + 1`` rows of ``logits``.

    ``logits`` ``[num_rows, vocab]`` (rows of one request consecutive, requests in ``drafts``'
    order); ``metadata`` has one row per logit row. ``draft_probs`` ``[num_rows, vocab]`` is the
    drafter's distribution at each draft row (bonus rows ignored), or None for point-mass drafts.
    ``logits`` is not changed.
    """
    num_rows = logits.shape[0]
    if num_rows != sum(len(d) + 1 for d in drafts):
        raise ValueError(f"{num_rows} logit rows for drafts needing {sum(len(d) + 1 for d in drafts)}")
    logits = logits.float().clone()  # [num_rows, vocab]
    raw_logprobs = None
    if metadata.max_num_logprobs is not None:
        raw_logprobs = torch.log_softmax(logits, dim=-1)  # [num_rows, vocab]
    for process in shared_processors(metadata):
        logits = process(logits)
    best = greedy_tokens(logits).tolist()  # [num_rows]
    if draft_probs is None:
        token_ids = _verify_point_masses(logits, metadata, drafts, best)
    else:
        token_ids = _verify_distributions(logits, metadata, drafts, draft_probs, best)
    emitted_rows: list[int] = []
    row = 0
    for group, emitted in zip(drafts, token_ids, strict=True):
        emitted_rows.extend(range(row, row + len(emitted)))
        row += len(group) + 1
    return VerifiedTokens(token_ids, _logprobs(raw_logprobs, token_ids, emitted_rows, metadata))


def _verify_point_masses(
    logits: torch.Tensor, metadata: SamplingMetadata, drafts: list[list[int]], best: list[int]
) -> list[list[int]]:
    """Drafts proposed with certainty (n-gram): each row's token is drawn from the target exactly as
    plain sampling draws it (one uniform, inverse transform; the argmax on greedy rows), and a draft
    is accepted when it is that token. That is the rejection sampler for ``q`` a point mass: draft
    ``d`` is accepted with probability ``p(d)``, and on a mismatch the token drawn is distributed as
    the residual ``p`` without ``d``, renormalised. A seeded request's generator is then advanced by
    one draw per emitted token, as plain sampling would: its output is the one it has without
    speculation, however many drafts each step verified."""
    picks = best
    if not metadata.all_greedy:
        states = {id(g): (g, g.get_state()) for g in metadata.generators.values()}
        probs = random_row_probs(logits, metadata)  # [num_rows, vocab]
        uniforms = row_uniforms(logits.shape[0], metadata.generators, logits.device)  # [num_rows]
        sampled = sample_from_probs(probs, uniforms).tolist()  # [num_rows]
        greedy_row = (metadata.temperature == 0.0).tolist()
        picks = [b if g else x for b, x, g in zip(best, sampled, greedy_row, strict=True)]
        for generator, state in states.values():
            generator.set_state(state)
    token_ids: list[list[int]] = []
    row = 0
    for group in drafts:
        emitted = [picks[row]]
        for j, draft in enumerate(group):
            if emitted[-1] != draft:
                break
            emitted.append(picks[row + j + 1])
        token_ids.append(emitted)
        if not metadata.all_greedy and row in metadata.generators:
            skip_draws(metadata.generators[row], len(emitted), logits.device)
        row += len(group) + 1
    return token_ids


def _verify_distributions(
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    drafts: list[list[int]],
    draft_probs: torch.Tensor,
    best: list[int],
) -> list[list[int]]:
    """Drafts from a drafter distribution ``q``: accept ``d`` with probability ``min(1, p(d) / q(d))``,
    else emit a draw from the residual ``max(0, p - q)``; greedy rows accept while the draft is the
    argmax. Two uniforms per row (acceptance, residual), every row, in order."""
    device = logits.device
    num_rows = logits.shape[0]
    draft_of_row: list[int] = []
    for group in drafts:
        draft_of_row.extend([*group, 0])  # the bonus row has no draft: any id, never read
    probs = random_row_probs(logits, metadata)  # [num_rows, vocab]
    draft_ids = torch.tensor(draft_of_row, dtype=torch.long, device=device)  # [num_rows]
    target = probs.gather(1, draft_ids[:, None]).squeeze(1)  # [num_rows] p(d)
    proposed = draft_probs.float().gather(1, draft_ids[:, None]).squeeze(1)  # [num_rows] q(d)
    bound = torch.where(proposed > 0, target / proposed.clamp_min(1e-30), 1.0).tolist()  # [num_rows]
    residual = (probs - draft_probs.float()).clamp_min_(0.0)  # [num_rows, vocab] max(0, p - q)
    bonus_rows = _bonus_rows(drafts, device)  # [num_requests]
    residual[bonus_rows] = probs[bonus_rows]  # the bonus token is drawn from p itself
    accept_u = row_uniforms(num_rows, metadata.generators, device).tolist()  # [num_rows]
    sample_u = row_uniforms(num_rows, metadata.generators, device)  # [num_rows]
    sampled = sample_from_probs(residual, sample_u).tolist()  # [num_rows]
    greedy_row = [True] * num_rows if metadata.all_greedy else (metadata.temperature == 0.0).tolist()
    token_ids: list[list[int]] = []
    row = 0
    for group in drafts:
        emitted: list[int] = []
        for j, draft in enumerate(group):
            r = row + j
            accepted = best[r] == draft if greedy_row[r] else accept_u[r] < bound[r]
            if not accepted:
                break
            emitted.append(draft)
        final = row + len(emitted)
        emitted.append(best[final] if greedy_row[final] else sampled[final])
        token_ids.append(emitted)
        row += len(group) + 1
    return token_ids


def _bonus_rows(drafts: list[list[int]], device: torch.device) -> torch.Tensor:
    rows, row = [], 0
    for group in drafts:
        row += len(group)
        rows.append(row)
        row += 1
    return torch.tensor(rows, dtype=torch.long, device=device)  # [num_requests]


def _logprobs(
    raw_logprobs: torch.Tensor | None,
    token_ids: list[list[int]],
    emitted_rows: list[int],
    metadata: SamplingMetadata,
) -> list[list[tuple[list[int], list[float], int]]] | None:
    """The raw target logprobs of every emitted token at the row that emitted it."""
    if raw_logprobs is None:
        return None
    assert metadata.max_num_logprobs is not None
    rows = torch.tensor(emitted_rows, dtype=torch.long, device=raw_logprobs.device)  # [num_emitted]
    flat = torch.tensor([t for group in token_ids for t in group], dtype=torch.long, device=rows.device)
    ids, values, ranks = gather_logprobs(raw_logprobs[rows], flat, metadata.max_num_logprobs)
    id_rows, value_rows, rank_list = ids.tolist(), values.tolist(), ranks.tolist()
    result: list[list[tuple[list[int], list[float], int]]] = []
    index = 0
    for group in token_ids:
        result.append([(id_rows[i], value_rows[i], rank_list[i]) for i in range(index, index + len(group))])
        index += len(group)
    return result
