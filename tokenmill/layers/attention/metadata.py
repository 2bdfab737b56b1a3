"""Attention metadata: what a backend's ``forward`` reads about the step, built once per step.

The backend that consumes it builds it (``AttentionBackend.build_metadata``) from the step's plain
per-sequence facts; every layer of the step shares it, so nothing here is rebuilt per layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionGroup:
    """Sequences attended together in one padded batch (decodes in one group, prompts in another).

    ``query_rows[s, q]`` is the row of sequence ``s``'s ``q``-th new token in the flat token batch
    (padding points at row 0 and is masked out); ``kv_slots[s, j]`` is the flat KV-cache slot of the
    sequence's ``j``-th token; ``mask[s, 0, q, j]`` says whether query ``q`` may attend to key ``j``
    (causal, inside the sequence). ``valid_rows`` lists the real query rows in ``[S * Q]`` order
    and ``valid_index`` their flat positions in the padded ``[S * Q]`` layout. ``kv_slots`` and
    ``mask`` serve attention that gathers the keys; they are built by ``gather_plan`` on first use, so
    a step whose kernels read the paged cache in place never builds them (a decode step's ~8 tensor
    operations, a prompt chunk's ``[S, Q, K]`` mask).

    For kernels that read the paged cache directly instead of gathering: ``block_tables[s]`` lists
    the sequence's physical blocks (padded with block 0), ``seq_lens[s]`` its length after this step,
    and ``sliding_window`` (None: full attention) how many trailing positions a query may see.
    ``spans`` lists, per sequence, ``(first row, start position, new tokens)`` when each sequence's
    rows are consecutive in the batch (always, as the runner builds batches), for per-sequence
    attention; ``first_row`` is derived from it.
    """

    query_rows: torch.Tensor  # [S, Q] int64
    valid_rows: torch.Tensor  # [num_valid] int64
    valid_index: torch.Tensor  # [num_valid] int64
    num_queries: int  # Q
    # () -> (kv_slots [S, K] int64, mask [S, 1, Q, K] bool), called once, on first use of either.
    gather_plan: Callable[[], tuple[torch.Tensor, torch.Tensor]] = field(repr=False, compare=False)
    block_tables: torch.Tensor | None = None  # [S, max_blocks] int64
    seq_lens: torch.Tensor | None = None  # [S] int64
    sliding_window: int | None = None
    spans: list[tuple[int, int, int]] | None = None
    _additive_masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    @functools.cached_property
    def _gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gather_plan()

    @property
    def kv_slots(self) -> torch.Tensor:
        """``[S, K]`` int64: the flat KV-cache slot of each sequence's keys."""
        return self._gathered[0]

    @property
    def mask(self) -> torch.Tensor:
        """``[S, 1, Q, K]`` bool: which keys each query may attend to."""
        return self._gathered[1]

    @functools.cached_property
    def first_row(self) -> int | None:
        """The first row when the valid rows are consecutive (``first_row, first_row + 1, ...``: every
        sequence has ``num_queries`` rows, right after the previous one's), so that a kernel can read
        and write them as one slice instead of gathering and scattering; else None."""
        if not self.spans:
            return None
        first = self.spans[0][0]
        consecutive = all(
            row == first + k * self.num_queries and num_new == self.num_queries
            for k, (row, _, num_new) in enumerate(self.spans)
        )
        return first if consecutive else None

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """``mask`` as scores to add (0 where allowed, -inf elsewhere) in ``dtype``, built once per step
        and shared by every layer (SDPA would otherwise convert the boolean mask in each layer)."""
        mask = self._additive_masks.get(dtype)
        if mask is None:
            mask = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)  # [S, 1, Q, K]
            mask.masked_fill_(~self.mask, float("-inf"))
            self._additive_masks[dtype] = mask
        return mask


@dataclass
class DecodesAndChunks:
    """A step's rows for kernels that attend decodes and prompt chunks apart: the rows of the groups
    with one query per sequence (``decode_rows``, each with its sequence's block table and length
    after the step), and every sequence of the other groups as a chunk (``chunk_spans[c]`` = first
    row, start position, new tokens; ``chunk_tables[c]`` its block table)."""

    decode_rows: torch.Tensor  # [D] int64
    decode_tables: torch.Tensor  # [D, max_blocks] int64
    decode_lens: torch.Tensor  # [D] int64
    chunk_spans: torch.Tensor  # [C, 3] int64
    chunk_tables: torch.Tensor  # [C, max_blocks] int64


@dataclass
class AttentionMetadata:
    """Where this step's new keys/values go (``slot_mapping``) and which groups attend together."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    groups: list[AttentionGroup]
    # Speculative verification: attend every row as a decode of its own where a backend can, so the
    # drafts' rows round as the decode steps they stand for (greedy output stays token-identical).
    rows_as_decodes_preferred: bool = False
    _rows_as_decodes: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _decodes_and_chunks: DecodesAndChunks | None = field(default=None, repr=False)

    def decodes_and_chunks(self) -> DecodesAndChunks:
        """The step's decode rows and prompt chunks (``DecodesAndChunks``), built once per step; needs
        every group's ``spans`` and ``block_tables`` (ValueError otherwise)."""
        if self._decodes_and_chunks is not None:
            return self._decodes_and_chunks
        if any(g.spans is None or g.block_tables is None for g in self.groups):
            raise ValueError("decodes_and_chunks needs every group's spans and block tables")
        width = max(int(g.block_tables.shape[1]) for g in self.groups if g.block_tables is not None)
        device = self.slot_mapping.device
        decode_rows: list[int] = []
        decode_lens: list[int] = []
        decode_tables: list[torch.Tensor] = []
        spans: list[tuple[int, int, int]] = []
        chunk_tables: list[torch.Tensor] = []
        for group in self.groups:
            assert group.spans is not None and group.block_tables is not None
            padded = torch.nn.functional.pad(group.block_tables, (0, width - group.block_tables.shape[1]))
            if group.num_queries == 1:
                decode_rows.extend(row for row, _, _ in group.spans)
                decode_lens.extend(start + 1 for _, start, _ in group.spans)
                decode_tables.append(padded)
            else:
                spans.extend(group.spans)
                chunk_tables.append(padded)
        empty = torch.zeros(0, width, dtype=torch.long, device=device)
        self._decodes_and_chunks = DecodesAndChunks(
            decode_rows=torch.tensor(decode_rows, dtype=torch.long, device=device),
            decode_tables=torch.cat(decode_tables) if decode_tables else empty,
            decode_lens=torch.tensor(decode_lens, dtype=torch.long, device=device),
            chunk_spans=torch.tensor(spans, dtype=torch.long).reshape(-1, 3),
            chunk_tables=torch.cat(chunk_tables) if chunk_tables else empty,
        )
        return self._decodes_and_chunks

    def rows_as_decodes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every query row of the step as a decode of its own, in row order: ``(block_tables [T,
        max_blocks], seq_lens [T])``, where row ``t`` carries its sequence's block table and the length
        up to and including its own token. Attention of each such row over its first ``seq_lens[t]``
        positions is the causal attention of the step (its keys and values are stored first), so a
        decode kernel can serve prompt chunks too. Built once per step (every layer shares it); needs
        every group's ``spans`` and ``block_tables`` (ValueError otherwise)."""
        if self._rows_as_decodes is not None:
            return self._rows_as_decodes
        if any(g.spans is None or g.block_tables is None for g in self.groups):
            raise ValueError("rows_as_decodes needs every group's spans and block tables")
        num_rows = int(self.slot_mapping.shape[0])
        width = max(int(g.block_tables.shape[1]) for g in self.groups if g.block_tables is not None)
        device = self.slot_mapping.device
        tables = torch.zeros(num_rows, width, dtype=torch.long, device=device)  # [T, max_blocks]
        seq_lens = torch.zeros(num_rows, dtype=torch.long, device=device)  # [T]
        for group in self.groups:
            assert group.spans is not None and group.block_tables is not None
            first_rows, starts, counts = (torch.tensor(c, dtype=torch.long) for c in zip(*group.spans))
            firsts = counts.cumsum(0) - counts  # [S] index of each sequence's first row among the group's
            owner = torch.repeat_interleave(torch.arange(len(group.spans)), counts)  # [n] each row's sequence
            offset = torch.arange(int(counts.sum())) - firsts[owner]  # [n] each row's index in its chunk
            rows = (first_rows[owner] + offset).to(device)  # [n]
            group_tables = group.block_tables.index_select(0, owner.to(device))  # [n, group width]
            tables[rows, : group_tables.shape[1]] = group_tables
            seq_lens[rows] = (starts[owner] + offset + 1).to(device)
        self._rows_as_decodes = (tables, seq_lens)
        return self._rows_as_decodes
