"""Batch-invariant multi-head latent attention for the deterministic mode (DeepSeek-V3's latent cache).

``MLAReferenceBackend``'s absorbed form (``layers/attention/mla.py``) for every row: each query row
is a decode of its own (``AttentionMetadata.rows_as_decodes``) over its sequence's cached latents up
to and including its own position, whatever the step's chunking, cache hits or other rows. Three
pieces, each with a fixed reduction order per row:

- the query's absorption of ``W_UK`` and the output's ``W_UV`` are one per-head product per row, a
  call of the same shape for every row (``_per_row_heads``), so no batched kernel picks its blocking
  by the number of rows;
- the attention over the latent is the CPU decode kernel's vector path (its reduction runs over
  16-slot tiles in position order, rows split across threads, never a row's reduction; ``tiles``
  off, so no AMX grouping of sequences), the latent plane passed as both keys and values as
  ``mla_cpu.py`` does; where the kernel does not take the dtypes or the width, a Python loop attends
  one row at a time in float32.

A prompt token's latent is the same from any chunk, so its cached row is too: chunking, prefix-cache
hits and recompute after preemption give the same bits.
"""

from __future__ import annotations

import torch

from tokenmill.layers.attention.cpu_paged import kernels_read
from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.layers.attention.mla import MLAReferenceBackend
from tokenmill.layers.cpu_kernels import MAX_HEAD_DIM, load_error, paged_attention_decode


class DeterministicMLABackend(MLAReferenceBackend):
    """``MLAReferenceBackend`` with every row attended as a decode of its own, in the absorbed form."""

    name = "mla_deterministic"

    @classmethod
    def like(cls, other: MLAReferenceBackend) -> DeterministicMLABackend:
        """This backend with ``other``'s shape, scale and up-projection."""
        return cls(
            other.num_heads,
            other.kv_lora_rank,
            other.qk_nope_head_dim,
            other.qk_rope_head_dim,
            other.v_head_dim,
            other.scale,
            other.kv_b_proj,
        )

    def forward(
        self,
        q_nope: torch.Tensor,  # [num_tokens, num_heads, qk_nope_head_dim]
        q_rope: torch.Tensor,  # [num_tokens, num_heads, qk_rope_head_dim], rotated
        latent: torch.Tensor,  # [num_tokens, kv_lora_rank], normalised
        k_rope: torch.Tensor,  # [num_tokens, qk_rope_head_dim], rotated
        kv_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The attention output ``[num_tokens, num_heads, v_head_dim]`` (``MLAReferenceBackend``'s
        contract)."""
        cache = self._store_latents(latent, k_rope, kv_cache, metadata.slot_mapping)  # [num_slots, W]
        tables, lengths = metadata.rows_as_decodes()  # [T, max_blocks], [T]
        w_uk, w_uv = self._up_weights()  # [H, nope, L], [H, v, L]
        q_latent = _per_row_heads(q_nope, w_uk)  # [T, H, L]
        query = torch.cat([q_latent, q_rope], dim=-1)  # [T, H, latent_width]
        if self._kernel_takes(query, kv_cache):
            plane = kv_cache[0]  # [num_blocks, block_size, 1, W]: the keys, and (its first L) the values
            attended = paged_attention_decode(
                query.contiguous(), plane, plane, tables, lengths, self.scale, None, tiles=False
            )  # [T, H, W]
        else:
            attended = self._attend_rows(query, cache, tables, lengths, kv_cache.shape[2])  # [T, H, W]
        values = _per_row_heads(attended[..., : self.kv_lora_rank], w_uv.transpose(1, 2))  # [T, H, v]
        return values.to(q_nope.dtype)

    def _kernel_takes(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        return (
            query.device.type == "cpu"
            and kv_cache.device.type == "cpu"
            and self.latent_width <= MAX_HEAD_DIM
            and load_error() is None
            and kernels_read(query.dtype, kv_cache.dtype)
        )

    def _attend_rows(
        self,
        query: torch.Tensor,  # [T, H, W]
        cache: torch.Tensor,  # [num_slots, W]
        tables: torch.Tensor,  # [T, max_blocks]
        lengths: torch.Tensor,  # [T]
        block_size: int,
    ) -> torch.Tensor:
        """The reference: one row at a time, in float32, over exactly its cached latents."""
        out = torch.empty_like(query)  # [T, H, W]
        for row, (table, length) in enumerate(zip(tables.tolist(), lengths.tolist(), strict=True)):
            positions = torch.arange(length)  # [n]
            slots = torch.tensor(table, dtype=torch.long)[positions // block_size] * block_size
            slots += positions % block_size  # [n]
            keys = cache.index_select(0, slots).float()  # [n, W]
            scores = (query[row].float() @ keys.T) * self.scale  # [H, n]
            probs = torch.softmax(scores, dim=-1)  # [H, n]
            out[row] = (probs @ keys).to(out.dtype)  # [H, W]
        return out


def _per_row_heads(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [T, H, k]`` times ``b [H, k, m]`` per head: ``[T, H, m]`` in ``a``'s dtype, each row its own
    batched product of one shape (``[H, 1, k] @ [H, k, m]``, in float32 for 16-bit inputs on CPU as
    ``mla._per_head_matmul`` does), so a row's bits do not depend on the other rows."""
    compute = (
        torch.float32 if a.device.type == "cpu" and a.dtype in (torch.bfloat16, torch.float16) else a.dtype
    )
    weights = b.to(compute)  # [H, k, m]
    out = a.new_empty(a.shape[0], a.shape[1], b.shape[2])  # [T, H, m]
    for row in range(a.shape[0]):
        out[row] = torch.bmm(a[row].to(compute).unsqueeze(1), weights).squeeze(1).to(a.dtype)  # [H, m]
    return out
