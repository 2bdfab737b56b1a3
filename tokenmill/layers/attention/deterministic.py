"""Batch-invariant attention for the deterministic mode (``EngineConfig.deterministic``).

Every query row attends as a decode of its own: over its sequence's keys and values up to and
including its own position (the last ``sliding_window`` of them, if any), read from the paged cache
after this step's keys and values are stored. The computation's shapes, and so its reduction
order, depend only on the row's position: not on the other rows of the step, the chunk the row came
in, or whether its prefix came from the prefix cache. A prompt token therefore gets the same bits
from a whole-prompt pass, from any chunking, from a cache hit and from a recompute after
preemption. The price is a Python loop over rows (one small attention per row and layer).
"""

from __future__ import annotations

import torch

from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.layers.attention.torch_ref import TorchReferenceBackend


class DeterministicBackend(TorchReferenceBackend):
    """``TorchReferenceBackend``'s metadata, with every row attended alone in float32."""

    name = "deterministic"

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        sinks: torch.Tensor | None = None,  # [num_heads]
    ) -> torch.Tensor:
        self._store_kv(key, value, kv_cache, metadata.slot_mapping)
        tables, lengths = metadata.rows_as_decodes()  # [T, max_blocks], [T]
        window = metadata.groups[0].sliding_window if metadata.groups else None
        block_size = kv_cache.shape[2]
        group = self.num_heads // self.num_kv_heads
        out = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
        for row, (table, length) in enumerate(zip(tables.tolist(), lengths.tolist(), strict=True)):
            first = 0 if window is None else max(0, length - window)
            blocks = torch.tensor(table[: -(-length // block_size)], dtype=torch.long)
            # [length, kv_heads, head_dim] each: the sequence's keys and values up to this row
            keys = kv_cache[0, blocks].flatten(0, 1)[first:length].float()
            values = kv_cache[1, blocks].flatten(0, 1)[first:length].float()
            keys = keys.repeat_interleave(group, dim=1)  # [n, num_heads, head_dim]
            values = values.repeat_interleave(group, dim=1)
            q = query[row].float()  # [num_heads, head_dim]
            scores = (keys * q).sum(-1) * self.scale  # [n, num_heads]
            if sinks is not None:  # a sink's logit joins each head's denominator, with no value
                scores = torch.cat([scores, sinks.float()[None, :]])  # [n + 1, num_heads]
            probs = torch.softmax(scores, dim=0)[: keys.shape[0]]  # [n, num_heads]
            out[row] = (probs.unsqueeze(-1) * values).sum(0).to(out.dtype)  # [num_heads, head_dim]
        return out
