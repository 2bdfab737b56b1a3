"""Per-step facts for layers that keep a fixed-size recurrent state per sequence (linear attention).

The state pool (``core/kv/state_pool.py`` hands out slot ids; ``worker/state_cache.py`` holds the
tensors) gives every running sequence one slot: in each recurrent layer, row ``slot`` of that layer's
state tensors. Before a step's forward the model runner has already zeroed the slots of sequences
that start from nothing and copied snapshots into the slots of sequences that resume from one; a
layer reads its sequences' slots, writes them back, and copies its state at the step's checkpoint
offsets into the snapshot slots named there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RecurrentSequence:
    """One sequence's share of a step: its rows ``first_row .. first_row + num_tokens - 1`` of the
    flattened batch, its state slot, and ``checkpoints``: ``(tokens into this step, snapshot slot)``
    pairs, each asking for the state after that many of its new tokens to be copied into that slot."""

    first_row: int
    num_tokens: int
    slot: int
    checkpoints: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class RecurrentBatch:
    """The recurrent-state side of a ``ForwardBatch``.

    ``caches[i]`` is the ``i``-th recurrent layer's list of state tensors, each ``[num_slots, ...]``.
    ``decodes`` are the sequences with one new token (run together), ``prefills`` the others (run one
    by one); ``decode_rows``/``decode_slots`` index the decodes' rows and slots as tensors.
    """

    caches: list[list[torch.Tensor]]
    decodes: list[RecurrentSequence]
    prefills: list[RecurrentSequence]
    decode_rows: torch.Tensor  # [num_decodes] int64
    decode_slots: torch.Tensor  # [num_decodes] int64

    @classmethod
    def build(
        cls, caches: list[list[torch.Tensor]], sequences: list[RecurrentSequence], device: torch.device
    ) -> RecurrentBatch:
        decodes = [s for s in sequences if s.num_tokens == 1]
        prefills = [s for s in sequences if s.num_tokens > 1]
        return cls(
            caches=caches,
            decodes=decodes,
            prefills=prefills,
            decode_rows=torch.tensor([s.first_row for s in decodes], dtype=torch.long, device=device),
            decode_slots=torch.tensor([s.slot for s in decodes], dtype=torch.long, device=device),
        )
