"""4-bit groups with float32 scales and minimums: a GGUF K-quant's 4-bit layers (Q4_K) kept exactly.

A Q4_K tensor stores super-blocks of 256 weights: a float16 ``d`` and ``dmin``, and per sub-block of
32 a 6-bit scale ``sc`` and minimum ``m``, with 4-bit levels ``q``; a weight is ``d sc q - dmin m``.
Per group of 32 that is layers/int4.py's form ``scale * q + min`` with ``scale = d * sc`` and
``min = -dmin * m``, which float32 holds exactly (17 significant bits at most) and float16 does not,
so int4's float16 format cannot take these layers; loaded in bfloat16 they stream 16 bits a weight.
``K4Weight`` keeps their levels packed as int4 packs them (byte ``j`` of a group holds elements ``j``
and ``j + 16``) with float32 scales and minimums, 4.5 + 1 bits a weight, and multiplies steps of 1 to
``INT4_PAIRS_MAX_ROWS`` bfloat16 rows on the level-sums kernel (``csrc/int4_pairs_cpu.cpp``, the op
``int4_sums_linear``: AVX512-BF16), which computes with the exact values ``scale * q + min``. The layer
keeps its bfloat16 weight (those values rounded, as the GGUF loader gives them) for larger steps,
other CPUs and the deterministic mode: not a quantization, as with the exact 8-bit groups of
layers/q8.py. The loader side (``loader/gguf_k4.py``) reads the groups from the file, and the model
runner gives them to the layers whose weight they hold exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.layers.int4 import INT4_PAIRS_MAX_ROWS


@dataclass
class K4Weight:
    """A weight's exact 4-bit groups with float32 scales, for steps of 1 to ``max_rows`` rows."""

    packed: torch.Tensor  # [out_features, in_features / 2] uint8
    scales: torch.Tensor  # [out_features, in_features / 32] float32
    mins: torch.Tensor  # [out_features, in_features / 32] float32
    max_rows: int = INT4_PAIRS_MAX_ROWS

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through the kernel: 2-D bfloat16 with 1 to ``max_rows`` rows."""
        return x.dim() == 2 and x.dtype == torch.bfloat16 and 0 < x.shape[0] <= self.max_rows

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` ``[rows, out_features]`` in bfloat16 with the exact values (float32 sums)."""
        x = x if x.stride(1) == 1 else x.contiguous()
        return torch.ops.tokenmill.int4_sums_linear(x, self.packed, self.scales, self.mins)

    def dequantize(self) -> torch.Tensor:
        """The values ``scale * q + min`` ``[out, in]`` in float32 (each rounded once), as the GGUF
        loader dequantizes them."""
        return k4_values(self.packed, self.scales, self.mins)


def pack_levels(levels: torch.Tensor) -> torch.Tensor:
    """Levels ``[out, in]`` (0..15, uint8) packed as layers/int4.py packs them: ``[out, in / 2]``."""
    out_features, in_features = levels.shape
    groups = levels.reshape(out_features, in_features // 32, 2, 16)  # [out, G, halves, 16]
    return (groups[:, :, 0] | (groups[:, :, 1] << 4)).reshape(out_features, in_features // 2)


def unpack_levels(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_levels`: ``[out, in]`` uint8 levels."""
    out_features = packed.shape[0]
    groups = packed.reshape(out_features, -1, 1, 16)  # [out, G, 1, 16]
    return torch.cat([groups & 0x0F, groups >> 4], dim=2).reshape(out_features, -1)


def k4_values(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """``scale * q + min`` per group in float32 ``[out, in]``: the product (exact) then the sum, each
    rounded to float32 as the GGUF dequantization does (``d * q - dm``)."""
    out_features = packed.shape[0]
    levels = unpack_levels(packed).reshape(out_features, -1, 32).float()  # [out, G, 32]
    return (levels * scales[..., None] + mins[..., None]).reshape(out_features, -1)
