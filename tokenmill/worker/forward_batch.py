"""The explicit per-step input of ``model.forward``: token ids, positions and paged-attention metadata.

Built once per step by the model runner and shared by every layer; nothing about the current batch
lives in globals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionGroup:
    """Sequences attended together in one padded batch (decodes in one group, prompts in another).

    ``query_rows[s, q]`` is the row of sequence ``s``'s ``q``-th new token in the flat token batch
    (padding points at row 0 and is masked out); ``kv_slots[s, j]`` is the flat KV-cache slot of the
    sequence's ``j``-th token; ``mask[s, 0, q, j]`` says whether query ``q`` may attend to key ``j``
    (causal, inside the sequence). ``valid_rows`` lists the real query rows in ``[S * Q]`` order
    and ``valid_index`` their flat positions in the padded ``[S * Q]`` layout.

    For kernels that read the paged cache directly instead of gathering: ``block_tables[s]`` lists
    the sequence's physical blocks (padded with block 0), ``seq_lens[s]`` its length after this step,
    and ``sliding_window`` (None: full attention) how many trailing positions a query may see.
    """

    query_rows: torch.Tensor  # [S, Q] int64
    kv_slots: torch.Tensor  # [S, K] int64
    mask: torch.Tensor  # [S, 1, Q, K] bool
    valid_rows: torch.Tensor  # [num_valid] int64
    valid_index: torch.Tensor  # [num_valid] int64
    num_queries: int  # Q
    block_tables: torch.Tensor | None = None  # [S, max_blocks] int64
    seq_lens: torch.Tensor | None = None  # [S] int64
    sliding_window: int | None = None


@dataclass
class AttentionMetadata:
    """Where this step's new keys/values go (``slot_mapping``) and which groups attend together."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    groups: list[AttentionGroup]


@dataclass
class ForwardBatch:
    """One step's input for ``model.forward``.

    ``seq_lens`` gives, per token, the length of its sequence after this step (dynamic rope needs
    it). ``kv_caches[layer]`` is that layer's paged cache ``[2, num_blocks, block_size, kv_heads,
    head_dim]``. ``logits_rows`` selects the token rows whose logits the caller needs.
    """

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    seq_lens: torch.Tensor  # [num_tokens] int64
    attn: AttentionMetadata
    kv_caches: list[torch.Tensor]
    logits_rows: torch.Tensor  # [num_logit_rows] int64

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
