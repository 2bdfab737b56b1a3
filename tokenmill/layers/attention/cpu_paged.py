"""CPU paged attention: decodes through the fused C++ decode kernel, prompt chunks through the
prefill kernel where the CPU has AVX512-BF16 (bfloat16) or AVX2 without AVX-512 (float32), else short
chunks as decodes and longer ones through the reference.

A decode group (one new token per sequence) attends straight from the paged cache through its block
tables, with no gather copy and no padded mask. In bfloat16 on CPUs with AVX512-BF16 every prompt
chunk attends through ``paged_prefill_attention``, one call a chunk, reading the blocks in place (AMX
tile products where granted, else AVX512-BF16 vectors; faster than the reference's gather and SDPA
at every length measured, and than running the chunk's rows as decodes from 4 tokens on); so do
float32 chunks on CPUs with AVX2 and no AVX-512 (AVX2 vectors, 20-25% faster than the reference on a
Zen 3). Elsewhere a step whose prompt chunks are all short (at most ``SHORT_CHUNK_MAX_QUERIES``
tokens), in bfloat16 or float16, runs every row through the decode kernel as a decode of its own
(``AttentionMetadata.rows_as_decodes``): the per-layer gather and SDPA call of a few-token chunk
cost more than the attention itself. Longer chunks keep the reference's gather + SDPA.

Float32 rows over a 16-bit cache (``--kv-cache-dtype``) take the same kernels (``kernels_read``);
other mixes of row and cache dtypes go through the reference. Attention sinks (gpt-oss) are in the
decode kernel only: prompt chunks of such layers attend through the reference's code.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from tokenmill.layers.attention.metadata import AttentionGroup, AttentionMetadata, DecodesAndChunks
from tokenmill.layers.attention.torch_ref import TorchReferenceBackend
from tokenmill.layers.cpu_kernels import (
    MAX_HEAD_DIM,
    paged_attention_decode,
    paged_prefill_attention,
    prefill_kernel_available,
    write_kv,
)

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernels_read(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the kernels take ``dtype`` rows over a ``cache_dtype`` cache: the same dtype (one of
    ``KERNEL_DTYPES``), or float32 rows over a bfloat16 or float16 cache (``--kv-cache-dtype``), which
    they widen to float32 as they read it and round to as they store it."""
    if dtype == cache_dtype:
        return dtype in KERNEL_DTYPES
    return dtype == torch.float32 and cache_dtype in (torch.bfloat16, torch.float16)


class StackAttention(NamedTuple):
    """The fused decode stack's attention arguments for a step: ``block_tables [R, max_blocks]`` and
    ``seq_lens [R]`` of the rows attending as decodes and their ``sliding_window``; with ``chunks``,
    those rows are ``chunks.decode_rows`` and the prompt chunks go through the prefill kernel, else
    every row of the step is a decode of its own."""

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    sliding_window: int | None
    chunks: DecodesAndChunks | None


# Prompt chunks of at most this many tokens attend through the decode kernel, one row per token. The
# kernel does a row's arithmetic with vector FMAs, SDPA with matrix kernels, so SDPA wins on long
# chunks over long contexts. Measured on a 2-core Xeon (bfloat16, SmolLM2's 9 / 3 heads of 64, four
# decodes beside one chunk): over 1,024 cached positions the kernel takes 392 vs 737 us at 4 tokens
# and breaks even at 32; over 256 positions 214 vs 379 us at 32 tokens, even between 64 and 128.
SHORT_CHUNK_MAX_QUERIES = 32


class CpuPagedBackend(TorchReferenceBackend):
    """Same contract as ``TorchReferenceBackend`` (new K/V written first, then causal attention per
    sequence) and the same metadata, whose block tables and spans its kernels read; needs the kernel
    loaded (``cpu_kernels.load_error()`` None) and CPU tensors. It also chooses whether a step runs
    through the fused CPU decoder stack (``stack_attention``, ``layers/fused_decode_stack.py``)."""

    name = "cpu"
    # The fused stack may pick kernels by the number of rows (fused_decode_stack.StackAttentionSource).
    stack_row_independent = False

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        sinks: torch.Tensor | None = None,  # [num_heads]
    ) -> torch.Tensor:
        """A step of decodes only (one group covering every row in order) returns the kernel's output
        itself instead of copying it into a new tensor; so does a step whose prompt chunks are all
        short (every row a decode of its own); anything else goes group by group. With ``sinks``
        (gpt-oss), decode groups take the decode kernel, which has them; the prefill kernel has not,
        so prompt chunks attend through the reference's code then."""
        rows = self.kernel_rows(metadata, query.shape[0], query.dtype, kv_cache)
        if rows is None:
            return super().forward(query, key, value, kv_cache, metadata, sinks)
        block_tables, seq_lens, window = rows
        self._store_kv(key, value, kv_cache, metadata.slot_mapping)
        with_sinks: dict[str, Any] = (
            {} if sinks is None else {"sinks": sinks}
        )  # a stand-in kernel may lack it
        return paged_attention_decode(
            query, kv_cache[0], kv_cache[1], block_tables, seq_lens, self.scale, window, **with_sinks
        )  # [num_tokens, num_heads, head_dim]

    def _decode(
        self,
        query: torch.Tensor,  # [S, num_heads, head_dim]: one row per sequence of the group, in order
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        group: AttentionGroup,
        sinks: torch.Tensor | None = None,  # [num_heads]
    ) -> torch.Tensor:
        assert group.block_tables is not None and group.seq_lens is not None
        with_sinks: dict[str, Any] = (
            {} if sinks is None else {"sinks": sinks}
        )  # a stand-in kernel may lack it
        return paged_attention_decode(
            query,
            kv_cache[0],
            kv_cache[1],
            group.block_tables,
            group.seq_lens,
            self.scale,
            group.sliding_window,
            **with_sinks,
        )  # [S, num_heads, head_dim]

    def _attend_group_with_sinks(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        group: AttentionGroup,
        out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        sinks: torch.Tensor,  # [num_heads]
    ) -> None:
        """A decode group through the decode kernel with the sinks; prompt chunks through the reference."""
        if not self._kernel_handles(query.dtype, kv_cache, group):
            super()._attend_group_with_sinks(query, kv_cache, group, out, sinks)
            return
        self._attend_decodes(query, kv_cache, group, out, sinks)

    def _attend_group(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        group: AttentionGroup,
        out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    ) -> None:
        if self._prefill_kernel_takes(query.dtype, kv_cache, group):
            assert group.spans is not None and group.block_tables is not None
            for s, (row, start, num_new) in enumerate(group.spans):
                out[row : row + num_new] = paged_prefill_attention(
                    query[row : row + num_new],
                    kv_cache[0],
                    kv_cache[1],
                    group.block_tables[s],
                    start,
                    self.scale,
                )  # [num_new, num_heads, head_dim]
            return
        if not self._kernel_handles(query.dtype, kv_cache, group):
            super()._attend_group(query, kv_cache, group, out)
            return
        self._attend_decodes(query, kv_cache, group, out)

    def _attend_decodes(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        group: AttentionGroup,
        out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        sinks: torch.Tensor | None = None,  # [num_heads]
    ) -> None:
        """A decode group (one row per sequence) through the decode kernel."""
        assert group.block_tables is not None and group.seq_lens is not None
        rows = group.valid_rows  # [S]: a decode group has one valid row per sequence
        first, num_seqs = group.first_row, group.block_tables.shape[0]
        selected = query.index_select(0, rows) if first is None else query[first : first + num_seqs]
        attended = self._decode(selected, kv_cache, group, sinks)  # [S, num_heads, head_dim]
        if first is None:
            out.index_copy_(0, rows, attended)
        else:
            out[first : first + num_seqs] = attended

    def _store_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None:
        rows_contiguous = key.stride()[1:] == value.stride()[1:] == (self.head_dim, 1)
        if key.dtype == value.dtype and kernels_read(key.dtype, kv_cache.dtype) and rows_contiguous:
            write_kv(key, value, kv_cache[0], kv_cache[1], slot_mapping)
        else:
            super()._store_kv(key, value, kv_cache, slot_mapping)

    def _prefill_kernel_takes(
        self, dtype: torch.dtype, kv_cache: torch.Tensor, group: AttentionGroup
    ) -> bool:
        """Whether ``group``'s prompt chunks attend through the prefill kernel, one call a chunk, with
        no window: bfloat16 with 16-slot blocks and head_dim 64 or 128 on a CPU with AVX512-BF16, or
        float32 (over a float32, bfloat16 or float16 cache) with head_dim a multiple of 8 (up to 256) on
        one with AVX2 and no AVX-512. The kernel reads the blocks in place where the reference gathers
        them and runs SDPA (causal, or under a mask over a cached prefix). Per layer with SmolLM2's
        heads, kernel vs reference: on a Xeon's AMX tiles 66 tokens over 1,024 cached positions 0.26 vs
        0.54 ms, 1,090 tokens from position 0 1.5 vs 3.2 ms; on a Zen 4's AVX512-BF16 vectors 0.63 vs
        2.8 ms and 5.3 vs 16.9 ms, 128 tokens 0.13 vs 0.92 ms, and 4 / 32 tokens over 1,024 positions
        92 / 329 us against 102 / 685 us as rows of the decode kernel; in float32 on a Zen 3's AVX2 vectors
        2.33 vs 2.89 ms and 15.7 vs 21.0 ms, 16 tokens over 1,024 positions 0.79 vs 1.13 ms."""
        if not (
            group.num_queries > 1
            and group.sliding_window is None
            and group.spans is not None
            and group.block_tables is not None
            and kernels_read(dtype, kv_cache.dtype)
        ):
            return False
        if dtype == torch.float32:
            return self.head_dim % 8 == 0 and self.head_dim <= 256 and prefill_kernel_available(dtype)
        return (
            dtype == torch.bfloat16 == kv_cache.dtype
            and kv_cache.shape[2] == 16
            and self.head_dim in (64, 128)
            and prefill_kernel_available()
        )

    def _kernel_takes_short_chunks(
        self, dtype: torch.dtype, kv_cache: torch.Tensor, group: AttentionGroup
    ) -> bool:
        """Whether ``group`` can join a step where every row attends as a decode of its own. Not in
        float32: that is the mode checked against transformers to 1e-4, and SDPA's matrix kernels and
        the decode kernel's vector loops round differently (a prompt logprob of a float32 MoE test
        moved by 1.0e-4); float32 prompts keep the reference."""
        return (
            group.num_queries <= SHORT_CHUNK_MAX_QUERIES
            and dtype != torch.float32
            and group.spans is not None
            and self._kernel_handles(dtype, kv_cache, group, any_queries=True)
        )

    def kernel_rows(
        self, metadata: AttentionMetadata, num_tokens: int, dtype: torch.dtype, kv_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int | None] | None:
        """``(block_tables [T, max_blocks], seq_lens [T], sliding_window)`` when ``forward`` attends every
        one of the step's ``num_tokens`` rows with one kernel call, each row a decode of its own in row
        order: a step of decodes only (one group, one query per sequence, rows in sequence order), or
        one whose prompt chunks are all short (``AttentionMetadata.rows_as_decodes``); else None. ``forward``
        attends such steps with these arguments, and so does the fused decode stack
        (``fused_decode_stack.FusedDecodeStack``)."""
        groups = metadata.groups
        if any(g.num_queries > 1 for g in groups):
            if not metadata.rows_as_decodes_preferred and self._chunks_take_prefill_kernel(
                dtype, kv_cache, groups
            ):
                return None  # group by group: the prefill kernel is faster than rows as decodes
            if not all(self._kernel_takes_short_chunks(dtype, kv_cache, g) for g in groups):
                return None
            block_tables, seq_lens = metadata.rows_as_decodes()
            return block_tables, seq_lens, groups[0].sliding_window
        if len(groups) != 1:
            return None
        group = groups[0]
        if (
            group.first_row != 0
            or not self._kernel_handles(dtype, kv_cache, group)
            or group.block_tables is None
            or group.seq_lens is None
            or group.block_tables.shape[0] != num_tokens
        ):
            return None
        return group.block_tables, group.seq_lens, group.sliding_window

    def stack_attention(
        self, metadata: AttentionMetadata, num_tokens: int, dtype: torch.dtype, kv_cache: torch.Tensor
    ) -> StackAttention | None:
        """How the fused decode stack (``fused_decode_stack.FusedDecodeStack``) attends this step's rows as
        ``forward`` would, with the same kernels on the same rows: every row a decode (``kernel_rows``),
        or decodes through the decode kernel and prompt chunks through the prefill kernel when that
        takes every chunk group (``_prefill_kernel_takes``); None when neither applies."""
        groups = metadata.groups
        as_decodes = metadata.rows_as_decodes_preferred and (
            self.kernel_rows(metadata, num_tokens, dtype, kv_cache) is not None
        )
        if (
            any(g.num_queries > 1 for g in groups)
            and not as_decodes
            and self._chunks_take_prefill_kernel(dtype, kv_cache, groups)
        ):
            split = metadata.decodes_and_chunks()
            return StackAttention(split.decode_tables, split.decode_lens, None, split)
        rows = self.kernel_rows(metadata, num_tokens, dtype, kv_cache)
        if rows is None:
            return None
        block_tables, seq_lens, window = rows
        return StackAttention(block_tables, seq_lens, window, None)

    def _chunks_take_prefill_kernel(
        self, dtype: torch.dtype, kv_cache: torch.Tensor, groups: list[AttentionGroup]
    ) -> bool:
        """Whether every group with prompt chunks attends through the prefill kernel and every other
        group through the decode kernel."""
        return all(
            self._prefill_kernel_takes(dtype, kv_cache, g)
            if g.num_queries > 1
            else g.spans is not None and self._kernel_handles(dtype, kv_cache, g)
            for g in groups
        )

    def _kernel_handles(
        self, dtype: torch.dtype, kv_cache: torch.Tensor, group: AttentionGroup, any_queries: bool = False
    ) -> bool:
        return (
            (any_queries or group.num_queries == 1)
            and group.block_tables is not None
            and group.seq_lens is not None
            and kernels_read(dtype, kv_cache.dtype)
            and self.head_dim <= MAX_HEAD_DIM
        )
