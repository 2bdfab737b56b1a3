"""MLA's absorbed decode on the CPU decode kernel (``csrc/paged_attention_cpu.cpp``), no new C++.

In the absorbed form every query head attends over the cached latent rows as one shared key/value
head of width ``kv_lora_rank + qk_rope_head_dim`` whose values are the latent part
(``layers/attention/mla.py``). That is exactly the decode kernel's multi-query attention with the
latent plane passed as both the key and the value cache: the kernel reads the rows in place through
the block tables (no gather, no mask) and returns ``[S, heads, width]``, of which the first
``kv_lora_rank`` columns are the attended latent (the last ``qk_rope_head_dim`` are the attended
rotary keys, computed for nothing: 11% extra work at DeepSeek-V3's 512 + 64; the kernel takes heads
up to ``MAX_HEAD_DIM``, 1024). Other dtype mixes and prompt chunks go through the reference.
"""

from __future__ import annotations

import torch

from tokenmill.layers.attention.cpu_paged import kernels_read
from tokenmill.layers.attention.metadata import AttentionGroup
from tokenmill.layers.attention.mla import MLAReferenceBackend
from tokenmill.layers.cpu_kernels import MAX_HEAD_DIM, paged_attention_decode


class MLACpuBackend(MLAReferenceBackend):
    """``MLAReferenceBackend`` with decode groups on the CPU decode kernel where it applies."""

    name = "mla_cpu"

    def _attend_latent(
        self,
        query: torch.Tensor,  # [S, H, Q, latent_width]
        kv_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, latent_width]
        group: AttentionGroup,
    ) -> torch.Tensor:
        """The attended latent ``[S, H, Q, kv_lora_rank]``."""
        if not self._kernel_takes(query, kv_cache, group):
            return super()._attend_latent(query, kv_cache, group)
        assert group.block_tables is not None and group.seq_lens is not None
        latent = kv_cache[0]  # [num_blocks, block_size, 1, W]: the keys, and (its first L) the values
        attended = paged_attention_decode(
            query[:, :, 0].contiguous(), latent, latent, group.block_tables, group.seq_lens, self.scale
        )  # [S, H, W]
        return attended[..., : self.kv_lora_rank].unsqueeze(2)  # [S, H, 1, L]

    def _kernel_takes(self, query: torch.Tensor, kv_cache: torch.Tensor, group: AttentionGroup) -> bool:
        return (
            group.num_queries == 1
            and group.sliding_window is None
            and group.block_tables is not None
            and group.seq_lens is not None
            and kv_cache.device.type == "cpu"
            and self.latent_width <= MAX_HEAD_DIM
            and kernels_read(query.dtype, kv_cache.dtype)
        )
