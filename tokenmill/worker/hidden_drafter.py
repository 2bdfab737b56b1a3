"""Drafting from the target's hidden states: what the ``mtp`` and ``eagle``/``eagle3`` proposers share.

A head (DeepSeek's MTP layer, ``models/deepseek_mtp.py``; an EAGLE head, ``models/eagle.py``) at
position ``p`` reads the target's features at ``p`` (its final hidden state, or for EAGLE-3 several
layers' concatenated) and the token at ``p + 1``. So the model runner hands this proposer every
step's features (``record``: one row per scheduled token, with the token it was computed for), and at
``propose`` the proposer runs the head over each request's positions it has not computed yet, up to
the one before the newest token: the last of those rows' logits give the first draft. Further drafts
chain the head on its own output (its hidden state stands in for the target's features, which do not
exist yet), one row a step, as far as ``num_speculative_tokens`` and ``draft_confidence`` allow.

A recorded row counts only while its token is still the sequence's token at its position: rows of
rejected drafts are dropped (a rejected draft never equals the token that replaced it). Positions the
target never computed (a prefix-cache hit) have no features; the head sees zeros there, which makes
those drafts worse but never the output: drafts are a deterministic function of what the proposer
saw, a point mass for the rejection sampler, as for ``draft_model``.

The head's KV cache has the target's block count; blocks are handed out by ``worker/draft_blocks.py``
(least recently drafted requests give theirs back first; a request that still does not fit gets no
drafts this step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from tokenmill.core.step_io import ScheduledRequest
from tokenmill.layers.attention.backend import AttentionBackend, SequenceStep
from tokenmill.layers.forward_batch import ForwardBatch
from tokenmill.spec.proposer import DraftContext
from tokenmill.worker.draft_blocks import DraftBlocks


class DraftHead(Protocol):
    """What the proposer drives. ``forward(previous, next_token_ids, batch)``: the head's hidden state
    ``[num_tokens, hidden_size]`` from the previous features (``feature_size`` wide from the target,
    ``hidden_size`` wide when chained) and the next tokens; its KV is ``batch.kv_caches[0]``.
    ``compute_logits``: ``[rows, draft_vocab]``; ``draft_to_target`` maps a draft id to the target's
    (None: the same vocabulary). ``attention_backend``: the class whose metadata its attention reads."""

    @property
    def feature_size(self) -> int: ...

    @property
    def draft_to_target(self) -> torch.Tensor | None: ...

    @property
    def attention_backend(self) -> type[AttentionBackend]: ...

    def forward(
        self, previous: torch.Tensor, next_token_ids: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass
class _Recorded:
    """Features the target computed for one request: row ``i`` is position ``start + i``, computed
    for token ``token_ids[i]``."""

    start: int
    token_ids: list[int]
    hidden: torch.Tensor  # [n, feature_size]


@dataclass
class _HeadState:
    """How many leading positions the head's cache holds for the request, and its block table."""

    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    recorded: list[_Recorded] = field(default_factory=list)


class HiddenStateProposer:
    """Drafts with ``head`` over the target's recorded features (see the module docstring).

    ``aux_layers``: the target layers whose input hidden states (residual stream) are the features,
    concatenated in order (EAGLE-3); empty: the target's final hidden state.
    """

    aux_layers: tuple[int, ...] = ()

    def __init__(
        self,
        head: DraftHead,
        kv_cache: list[torch.Tensor],
        num_blocks: int,
        block_size: int,
        draft_confidence: float,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.head = head
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.draft_confidence = draft_confidence
        self.device = device
        self.dtype = dtype  # the head's activations
        self.blocks: DraftBlocks[_HeadState] = DraftBlocks(num_blocks, block_size, _HeadState)

    @property
    def free_blocks(self) -> list[int]:
        return self.blocks.free

    @property
    def states(self):  # type: ignore[no-untyped-def]
        return self.blocks.states

    # ------------------------------------------------------------------ the runner's side

    def record(self, entries: list[ScheduledRequest], hidden: torch.Tensor, batch: ForwardBatch) -> None:
        """Keep this step's features (rows in ``entries`` order): ``hidden`` ``[num_tokens, hidden]``,
        or ``batch.aux_hidden`` concatenated when the head reads several layers."""
        if self.aux_layers:
            features = torch.cat(batch.aux_hidden, dim=-1)  # [num_tokens, len(aux_layers) * hidden]
        else:
            features = hidden
        row = 0
        for entry in entries:
            count = len(entry.token_ids)
            state = self.blocks.state(entry.request_id)
            state.recorded.append(
                _Recorded(entry.start_position, list(entry.token_ids), features[row : row + count].clone())
            )
            row += count

    def drop(self, request_ids: list[str]) -> None:
        self.blocks.drop(request_ids)

    # ------------------------------------------------------------------ drafting

    @torch.inference_mode()
    def propose(self, contexts: list[DraftContext]) -> dict[str, list[int]]:
        in_call = {c.request_id for c in contexts}
        rows: list[tuple[DraftContext, _HeadState, torch.Tensor, list[int]]] = []
        for context in contexts:
            state = self.blocks.prepare(
                context.request_id, len(context.token_ids) + context.max_drafts, in_call
            )
            if state is None:
                continue
            state.num_computed = min(state.num_computed, len(context.token_ids) - 1)
            previous, next_tokens = self._catch_up_inputs(context, state)
            if next_tokens:
                rows.append((context, state, previous, next_tokens))
        drafts: dict[str, list[int]] = {}
        if not rows:
            return drafts
        # One step over every request's uncomputed positions; its last rows' logits draft first.
        starts = [state.num_computed for _, state, _, _ in rows]
        hidden, logits = self._run(
            [(s, state.block_table, tokens) for s, (_, state, _, tokens) in zip(starts, rows)],
            torch.cat([previous for _, _, previous, _ in rows]),
        )
        for _, state, _, tokens in rows:
            state.num_computed += len(tokens)
        active = []
        for i, ((context, state, _, _), token) in enumerate(zip(rows, self._confident(logits), strict=True)):
            if token is None:
                continue
            drafts[context.request_id] = [token]
            if context.max_drafts > 1:
                active.append((context, state, hidden[i : i + 1], token))
        # Chained drafts: the head's own hidden state stands in for the target's features.
        while active:
            steps = [
                (state.num_computed + len(drafts[c.request_id]) - 1, state.block_table, [token])
                for c, state, _, token in active
            ]
            hidden, logits = self._run(steps, torch.cat([h for _, _, h, _ in active]))
            still = []
            for i, ((context, state, _, _), token) in enumerate(
                zip(active, self._confident(logits), strict=True)
            ):
                if token is None:
                    continue
                drafts[context.request_id].append(token)
                if len(drafts[context.request_id]) < context.max_drafts:
                    still.append((context, state, hidden[i : i + 1], token))
            active = still
        return drafts

    def _confident(self, logits: torch.Tensor) -> list[int | None]:
        """Per row of ``logits`` ``[rows, draft_vocab]``: the greedy draft (a target token id), or
        None when its probability is below ``draft_confidence``."""
        confidence, tokens = torch.softmax(logits.float(), dim=-1).max(dim=-1)  # [rows] each
        d2t = self.head.draft_to_target
        if d2t is not None:
            tokens = d2t[tokens]
        return [
            token if conf >= self.draft_confidence else None
            for token, conf in zip(tokens.tolist(), confidence.tolist(), strict=True)
        ]

    def _catch_up_inputs(self, context: DraftContext, state: _HeadState) -> tuple[torch.Tensor, list[int]]:
        """The target features of positions ``num_computed .. len - 2`` (zeros where none was
        recorded for the sequence's token there) and the tokens after them."""
        sequence = context.token_ids
        first, last = state.num_computed, len(sequence) - 2
        previous = torch.zeros(max(0, last - first + 1), self.head.feature_size, dtype=self.dtype)
        for recorded in state.recorded:  # later steps overwrite earlier rows of the same position
            for i, token in enumerate(recorded.token_ids):
                position = recorded.start + i
                if first <= position <= last and sequence[position] == token:
                    previous[position - first] = recorded.hidden[i]
        state.recorded.clear()
        return previous.to(self.device), list(sequence[first + 1 : last + 2])

    def _run(
        self, steps: list[tuple[int, list[int], list[int]]], previous: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the head over ``steps`` (start position, block table, next tokens each; rows in order)
        with ``previous`` features; returns each step's last row's hidden state and logits."""
        bs = self.block_size
        sequences: list[SequenceStep] = []
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        for start, table, tokens in steps:
            sequences.append(SequenceStep(len(token_ids), start, len(tokens), table))
            token_ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + len(tokens)))
            last_rows.append(len(token_ids) - 1)
        device = self.device
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        attn = self.head.attention_backend.build_metadata(sequences, slot_mapping, bs, [None])[None]
        seq_lens = [s.start_position + s.num_new_tokens for s in sequences for _ in range(s.num_new_tokens)]
        batch = ForwardBatch(
            input_ids=torch.tensor(token_ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=device),
            attn=attn,
            kv_caches=self.kv_cache,
            logits_rows=torch.tensor(last_rows, dtype=torch.long, device=device),
        )
        hidden = self.head.forward(previous, batch.input_ids, batch)[batch.logits_rows]  # [steps, hidden]
        return hidden, self.head.compute_logits(hidden)  # [num_steps, draft_vocab]
