"""The attention backend interface: a backend builds the step's metadata and attends with it.

The model runner knows the step as plain facts per sequence (``SequenceStep``) and the slot of each
new token; it does not know what a backend needs to attend (masks, gather indices, block tables in
some layout). ``build_metadata`` turns those facts into the backend's metadata once per step, for
each distinct sliding window the model declares; every layer's ``forward`` then reads it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from tokenmill.layers.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class SequenceStep:
    """One sequence's part of a step: its new tokens are the batch rows ``row_offset`` to
    ``row_offset + num_new_tokens - 1``, at positions from ``start_position`` on; ``block_table`` lists
    its physical KV blocks in order (a negative entry is a block the KV manager released: outside
    every layer's window, never attended)."""

    row_offset: int
    start_position: int
    num_new_tokens: int
    block_table: Sequence[int]


class AttentionBackend(ABC):
    """Attention over a paged KV cache, one instance per attention layer.

    Contract: ``forward`` first stores this step's keys and values at ``metadata.slot_mapping``, then
    every query attends to its own sequence's cached tokens up to its own position (within the
    metadata's sliding window, if any). With ``sinks`` (gpt-oss's attention sinks: one learned logit
    per query head), each head's softmax denominator also counts ``exp(sinks[h])``, a key that has no
    value; a backend whose kernels lack sinks attends such layers through the reference's code, never
    ignoring them. Every backend is tested against ``TorchReferenceBackend``.
    """

    name: ClassVar[str]

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    @classmethod
    @abstractmethod
    def build_metadata(
        cls,
        sequences: Sequence[SequenceStep],
        slot_mapping: torch.Tensor,  # [num_tokens] int64: the flat cache slot of each new token
        block_size: int,
        sliding_windows: Sequence[int | None],
    ) -> dict[int | None, AttentionMetadata]:
        """The step's metadata for each distinct window in ``sliding_windows`` (None: full attention),
        on ``slot_mapping``'s device. Called once per step; layers share the result."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        sinks: torch.Tensor | None = None,  # [num_heads]: per-head sink logits, or None
    ) -> torch.Tensor:
        """The attention output ``[num_tokens, num_heads, head_dim]`` (see the class contract)."""
