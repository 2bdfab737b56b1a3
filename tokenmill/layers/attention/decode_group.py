"""The attention group of a step's decodes (one new token per sequence), built with few torch ops.

:func:`torch_ref.build_group` serves any mix of chunk lengths with about 25 tensor operations and a
tensor per sequence for its block table; a single-sequence decode step of a 135M model takes ~6 ms,
so that ~0.1-0.2 ms is a few percent of every step. With one query per sequence the group is simpler:
the queries are the sequences' rows, every row is valid, and the mask compares key positions with
each sequence's start position. :func:`build_decode_group` returns the very tensors ``build_group``
returns for such members (tests/unit/test_decode_group.py compares them field by field).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.layers.attention.backend import SequenceStep
from tokenmill.layers.attention.metadata import AttentionGroup


def build_decode_group(
    members: Sequence[SequenceStep], block_size: int, sliding_window: int | None, device: torch.device
) -> AttentionGroup:
    """``build_group(members, ...)`` for members with one new token each (ValueError otherwise)."""
    if any(s.num_new_tokens != 1 for s in members) or not members:
        raise ValueError("build_decode_group takes a non-empty list of one-token decodes")
    bs = block_size
    start_list = [s.start_position for s in members]
    num_keys = max(start_list) + 1
    max_blocks = -(-num_keys // bs)
    rows: list[list[int]] = []
    for s in members:
        table = [max(b, 0) for b in s.block_table[:max_blocks]]  # released blocks read block 0
        rows.append(table + [0] * (max_blocks - len(table)))
    tables = torch.tensor(rows, dtype=torch.long)  # [S, max_blocks]
    starts = torch.tensor(start_list, dtype=torch.long)  # [S]
    offsets = [s.row_offset for s in members]
    row_offsets = torch.tensor(offsets, dtype=torch.long)  # [S]

    def gather_plan() -> tuple[torch.Tensor, torch.Tensor]:
        key_index = torch.arange(num_keys)  # [K]
        kv_slots = tables[:, key_index // bs] * bs + key_index % bs  # [S, K]
        mask = key_index[None, :] <= starts[:, None]  # [S, K]
        if sliding_window is not None:
            mask &= key_index[None, :] > starts[:, None] - sliding_window
        return kv_slots.to(device), mask[:, None, None, :].to(device)  # [S, K], [S, 1, 1, K]

    return AttentionGroup(
        query_rows=row_offsets[:, None].to(device),  # [S, 1]
        gather_plan=gather_plan,
        valid_rows=row_offsets.to(device),
        valid_index=torch.arange(len(members), device=device),
        num_queries=1,
        block_tables=tables.to(device),
        seq_lens=(starts + 1).to(device),
        sliding_window=sliding_window,
        spans=[(s.row_offset, s.start_position, 1) for s in members],
    )
