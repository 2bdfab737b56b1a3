"""Batch-invariant attention for the deterministic mode (``EngineConfig.deterministic``).

Every query row attends as a decode of its own (``AttentionMetadata.rows_as_decodes``): over its
sequence's keys and values up to and including its own position (the last ``sliding_window`` of
them, if any), read from the paged cache after this step's keys and values are stored. The
computation of a row then depends only on its position and its sequence's cache: not on the other
rows of the step, the chunk the row came in, or whether its prefix came from the prefix cache. A
prompt token therefore gets the same bits from a whole-prompt pass, from any chunking, from a cache
hit and from a recompute after preemption.

Where the CPU kernels are built, one call of the decode kernel (``csrc/paged_attention_cpu.cpp``)
attends all rows: its reduction over a row's keys runs in fixed 16-slot tiles in position order,
and rows are split across threads, never a row's reduction (``tests/unit/test_cpu_attention.py``
checks its bits do not depend on the batch or the thread count); its vector path is used, not the
AMX tiles, whose grouping of sequences sharing blocks is a batch property. Elsewhere (no kernel, a
dtype or head size it does not take) a Python loop attends one row at a time in float32.

The fused decode stack (``layers/fused_decode_stack.py``) attends through ``stack_attention``: the
same rows as decodes on the same kernel, declared row-independent (``stack_row_independent``), so
the stack runs its row-independent variant, with the layer modules' bits, for the steps it takes.
"""

from __future__ import annotations

import torch

from tokenmill.layers.attention.cpu_paged import KERNEL_DTYPES, StackAttention
from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.layers.attention.torch_ref import TorchReferenceBackend
from tokenmill.layers.cpu_kernels import MAX_HEAD_DIM, load_error, paged_attention_decode


class DeterministicBackend(TorchReferenceBackend):
    """``TorchReferenceBackend``'s metadata, with every row attended as a decode of its own."""

    name = "deterministic"
    stack_row_independent = True  # fused_decode_stack.StackAttentionSource

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
        if self._kernel_takes(query, kv_cache):
            return paged_attention_decode(
                query, kv_cache[0], kv_cache[1], tables, lengths, self.scale, window, tiles=False, sinks=sinks
            )  # [num_tokens, num_heads, head_dim]
        return self._attend_rows(query, kv_cache, tables, lengths, window, sinks)

    def stack_attention(
        self, metadata: AttentionMetadata, num_tokens: int, dtype: torch.dtype, kv_cache: torch.Tensor
    ) -> StackAttention | None:
        """Every row of the step a decode on the decode kernel, as ``forward`` attends it, or None where
        ``forward`` would not use the kernel (the step then runs the layer modules: so does every step
        of this model, the condition holding for all or none)."""
        if not self._kernel_takes_dtype(kv_cache.device, dtype, kv_cache):
            return None
        tables, lengths = metadata.rows_as_decodes()  # [T, max_blocks], [T]
        assert tables.shape[0] == num_tokens, (tables.shape, num_tokens)
        window = metadata.groups[0].sliding_window if metadata.groups else None
        return StackAttention(tables, lengths, window, None)

    def _kernel_takes(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        return self._kernel_takes_dtype(query.device, query.dtype, kv_cache)

    def _kernel_takes_dtype(self, device: torch.device, dtype: torch.dtype, kv_cache: torch.Tensor) -> bool:
        return (
            device.type == "cpu"
            and dtype == kv_cache.dtype
            and dtype in KERNEL_DTYPES
            and self.head_dim <= MAX_HEAD_DIM
            and load_error() is None
        )

    def _attend_rows(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        tables: torch.Tensor,  # [num_tokens, max_blocks]
        lengths: torch.Tensor,  # [num_tokens]
        window: int | None,
        sinks: torch.Tensor | None,  # [num_heads]
    ) -> torch.Tensor:
        """The reference: one row at a time, in float32, over exactly its keys (and the sinks)."""
        block_size = kv_cache.shape[2]
        group = self.num_heads // self.num_kv_heads
        key_cache = kv_cache[0].view(-1, self.num_kv_heads, self.head_dim)  # [num_slots, kv_heads, head_dim]
        value_cache = kv_cache[1].view(-1, self.num_kv_heads, self.head_dim)
        out = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
        for row, (table, length) in enumerate(zip(tables.tolist(), lengths.tolist(), strict=True)):
            first = 0 if window is None else max(0, length - window)
            positions = torch.arange(first, length)  # [n]
            slots = torch.tensor(table, dtype=torch.long)[positions // block_size] * block_size
            slots += positions % block_size  # [n]
            keys = key_cache.index_select(0, slots).float().repeat_interleave(group, dim=1)  # [n, H, D]
            values = value_cache.index_select(0, slots).float().repeat_interleave(group, dim=1)
            scores = (keys * query[row].float()).sum(-1) * self.scale  # [n, num_heads]
            if sinks is not None:  # a sink's logit joins each head's denominator, with no value
                scores = torch.cat([scores, sinks.float()[None, :]])  # [n + 1, num_heads]
            probs = torch.softmax(scores, dim=0)[: keys.shape[0]]  # [n, num_heads]
            out[row] = (probs.unsqueeze(-1) * values).sum(0).to(out.dtype)  # [num_heads, head_dim]
        return out
