"""Multi-head latent attention (MLA, DeepSeek-V2/V3, Kimi K2) over a latent paged cache.

A token's keys and values for every head are a linear function of one compressed vector: the
normalised latent ``c`` (``kv_lora_rank`` wide), expanded per head by ``kv_b_proj`` into the key's
non-rotary part (``W_UK``) and the value (``W_UV``), plus one rotary key ``k_rope``
(``qk_rope_head_dim`` wide) shared by all heads. The cache therefore stores, per token, one "head" of
``kv_lora_rank + qk_rope_head_dim`` values: ``[1, num_blocks, block_size, 1, kv_lora_rank +
qk_rope_head_dim]`` per layer (the ``KVCacheSpec`` of ``models/deepseek_v3.py``), instead of
``2 * num_heads * head_dim``.

Two exact forms of the same attention, chosen per group of the step's metadata:

- expanded (prompt chunks): the group's cached latents are expanded to per-head keys and values
  through ``kv_b_proj`` and attended as ordinary multi-head attention;
- absorbed (decodes, and speculative verification rows): ``W_UK`` is folded into the query
  (``q_nope @ W_UK`` lives in latent space), so every head attends directly over the cached latent
  as a single shared key/value head (multi-query attention of width ``kv_lora_rank +
  qk_rope_head_dim`` whose values are the latent part), and ``W_UV`` is applied to the attended
  latent afterwards. Nothing per head is ever materialised per cached token.

Both use the reference metadata (``TorchReferenceBackend.build_metadata``: gather indices, causal
masks, spans), so block tables, chunked prefill, prefix-cache hits and preemption work unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.layers.attention.metadata import AttentionGroup, AttentionMetadata
from tokenmill.layers.linear import LinearBase


class MLAReferenceBackend:
    """MLA in plain torch over the latent cache (see the module docstring), one instance per layer.

    ``kv_b_proj`` is the layer's up-projection module (weight ``[num_heads * (qk_nope_head_dim +
    v_head_dim), kv_lora_rank]``); it is read at every call, so weight updates apply at once.
    Contract of ``forward``: this step's latents and rotary keys are stored at
    ``metadata.slot_mapping`` first, then every query attends causally to its own sequence.
    """

    name = "mla_torch"

    def __init__(
        self,
        num_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
        kv_b_proj: LinearBase,
    ) -> None:
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.scale = scale
        self.kv_b_proj = kv_b_proj

    @property
    def latent_width(self) -> int:
        """One cached token's width: the latent plus the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def forward(
        self,
        q_nope: torch.Tensor,  # [num_tokens, num_heads, qk_nope_head_dim]
        q_rope: torch.Tensor,  # [num_tokens, num_heads, qk_rope_head_dim], rotated
        latent: torch.Tensor,  # [num_tokens, kv_lora_rank], normalised
        k_rope: torch.Tensor,  # [num_tokens, qk_rope_head_dim], rotated
        kv_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The attention output ``[num_tokens, num_heads, v_head_dim]`` (see the class contract)."""
        cache = self._store_latents(latent, k_rope, kv_cache, metadata.slot_mapping)  # [num_slots, W]
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_head_dim)  # [T, H, v_head_dim]
        for group in metadata.groups:
            if group.num_queries == 1 or metadata.rows_as_decodes_preferred:
                self._attend_absorbed(q_nope, q_rope, kv_cache, group, out)
            else:
                self._attend_expanded(q_nope, q_rope, cache, group, out)
        return out

    def _store_latents(
        self,
        latent: torch.Tensor,  # [num_tokens, kv_lora_rank], normalised
        k_rope: torch.Tensor,  # [num_tokens, qk_rope_head_dim], rotated
        kv_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, latent_width]
        slot_mapping: torch.Tensor,  # [num_tokens]
    ) -> torch.Tensor:
        """Write the step's tokens (latent, then rotary key, in the cache's dtype) into their slots;
        returns the cache as rows ``[num_slots, latent_width]`` (a view: later reads see the writes)."""
        cache = kv_cache[0].view(-1, self.latent_width)  # [num_slots, latent_width]
        new = torch.cat([latent, k_rope], dim=-1).to(cache.dtype)  # [num_tokens, latent_width]
        cache.index_copy_(0, slot_mapping, new)
        return cache

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK [num_heads, qk_nope_head_dim, kv_lora_rank]`` and ``W_UV [num_heads, v_head_dim,
        kv_lora_rank]``: views of ``kv_b_proj``'s weight."""
        weight = self.kv_b_proj.weight.view(
            self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank
        )  # [H, nope + v, L]
        return weight[:, : self.qk_nope_head_dim], weight[:, self.qk_nope_head_dim :]

    def _attend_absorbed(
        self,
        q_nope: torch.Tensor,  # [T, H, nope]
        q_rope: torch.Tensor,  # [T, H, rope]
        kv_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, latent_width]
        group: AttentionGroup,
        out: torch.Tensor,  # [T, H, v_head_dim]
    ) -> None:
        """Attention in latent space: the query absorbs ``W_UK``, the output ``W_UV``."""
        w_uk, w_uv = self._up_weights()
        num_seqs, num_queries = group.query_rows.shape
        rows = group.query_rows.view(-1)  # [S*Q]
        q_latent = _per_head_matmul(q_nope.index_select(0, rows).transpose(0, 1), w_uk)  # [H, S*Q, L]
        query = torch.cat(
            [q_latent.transpose(0, 1), q_rope.index_select(0, rows)], dim=-1
        )  # [S*Q, H, latent_width]
        query = query.view(num_seqs, num_queries, self.num_heads, -1).transpose(1, 2)  # [S, H, Q, W]
        attended = self._attend_latent(query, kv_cache, group)  # [S, H, Q, L]
        attended = attended.transpose(1, 2).reshape(-1, self.num_heads, self.kv_lora_rank)  # [S*Q, H, L]
        if num_queries > 1:
            attended = attended.index_select(0, group.valid_index)  # [num_valid, H, L]
        values = _per_head_matmul(attended.transpose(0, 1), w_uv.transpose(1, 2))  # [H, n, v]
        out.index_copy_(0, group.valid_rows, values.transpose(0, 1).to(out.dtype))

    def _attend_latent(
        self,
        query: torch.Tensor,  # [S, H, Q, latent_width]: q_nope @ W_UK beside q_rope
        kv_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, latent_width]
        group: AttentionGroup,
    ) -> torch.Tensor:
        """The attended latent ``[S, H, Q, kv_lora_rank]``: multi-query attention over the group's
        cached rows, whose latent part is also the value."""
        num_seqs, num_keys = group.kv_slots.shape
        cache = kv_cache[0].view(-1, self.latent_width)  # [num_slots, latent_width]
        keys = cache.index_select(0, group.kv_slots.view(-1)).to(query.dtype)  # [S*K, W]
        keys = keys.view(num_seqs, 1, num_keys, self.latent_width)  # [S, 1, K, W]
        return F.scaled_dot_product_attention(
            query,
            keys,
            keys[..., : self.kv_lora_rank],  # [S, 1, K, L]: the values are the latents
            attn_mask=group.additive_mask(query.dtype),
            scale=self.scale,
            enable_gqa=True,
        )  # [S, H, Q, L]

    def _attend_expanded(
        self,
        q_nope: torch.Tensor,  # [T, H, nope]
        q_rope: torch.Tensor,  # [T, H, rope]
        cache: torch.Tensor,  # [num_slots, latent_width]
        group: AttentionGroup,
        out: torch.Tensor,  # [T, H, v_head_dim]
    ) -> None:
        """Per sequence of the group: expand its cached latents to per-head keys and values, attend."""
        assert group.spans is not None
        nope, heads = self.qk_nope_head_dim, self.num_heads
        for s, (row, start, num_new) in enumerate(group.spans):
            num_keys = start + num_new
            cached = cache.index_select(0, group.kv_slots[s, :num_keys]).to(q_nope.dtype)  # [K, W]
            kv = self.kv_b_proj(cached[:, : self.kv_lora_rank]).view(num_keys, heads, -1)  # [K, H, nope+v]
            k_rope = cached[:, None, self.kv_lora_rank :].expand(num_keys, heads, self.qk_rope_head_dim)
            keys = torch.cat([kv[..., :nope], k_rope], dim=-1).transpose(0, 1)  # [H, K, nope + rope]
            values = kv[..., nope:].transpose(0, 1)  # [H, K, v]
            query = torch.cat([q_nope[row : row + num_new], q_rope[row : row + num_new]], dim=-1).transpose(
                0, 1
            )  # [H, n, nope + rope]
            if start == 0:
                attended = F.scaled_dot_product_attention(
                    query, keys, values, is_causal=True, scale=self.scale
                )  # [H, n, v]
            else:
                mask = group.additive_mask(query.dtype)[s, :, :num_new, :num_keys]  # [1, n, K]
                attended = F.scaled_dot_product_attention(
                    query, keys, values, attn_mask=mask, scale=self.scale
                )  # [H, n, v]
            out[row : row + num_new] = attended.transpose(0, 1).to(out.dtype)  # [n, H, v]


def _per_head_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [H, n, k] @ b [H, k, m]`` in ``a``'s dtype. On CPU, 16-bit batched matmuls take a slow path
    (about 10x float32's time at MLA's per-head shapes), so they run in float32 and are rounded once."""
    if a.device.type == "cpu" and a.dtype in (torch.bfloat16, torch.float16):
        return torch.bmm(a.float(), b.float()).to(a.dtype)
    return torch.bmm(a, b.to(a.dtype))
