"""MXFP4 (OCP microscaling FP4) weights, as gpt-oss checkpoints store their experts: dequantized on load.

A checkpoint tensor ``W [..., n]`` is stored as two tensors: ``*_blocks [..., n / 32, 16]`` uint8, each
byte two FP4 (e2m1) codes, the element at the even index in the low nibble and the odd one in the high
nibble; and ``*_scales [..., n / 32]`` uint8, one E8M0 exponent per group of 32 elements (the group's
values are multiplied by ``2 ** (scale - 127)``). E2M1 has sixteen values: sign, then
0, 0.5, 1, 1.5, 2, 3, 4, 6. Every such value times a power of two is exact in bfloat16 and float32.
"""

from __future__ import annotations

import torch

GROUP = 32  # elements sharing one scale
E8M0_BIAS = 127
# The E2M1 code points in code order (the high bit is the sign).
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weights ``[..., groups * 32]`` in ``dtype`` of ``blocks [..., groups, 16]`` (uint8, two codes a
    byte, low nibble first) and ``scales [..., groups]`` (uint8 E8M0 exponents). ValueError when the
    shapes do not pair up."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != GROUP // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair up: blocks must "
            f"be [..., groups, {GROUP // 2}] over scales [..., groups]"
        )
    table = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)  # [16]
    codes = blocks.to(torch.int64)  # [..., groups, 16]
    values = torch.stack([table[codes & 0x0F], table[codes >> 4]], dim=-1)  # [..., groups, 16, 2]
    values = values.flatten(-2)  # [..., groups, 32]: even elements from the low nibbles
    exponents = scales.to(torch.int32) - E8M0_BIAS  # [..., groups]
    values = torch.ldexp(values, exponents[..., None].float())  # [..., groups, 32]
    return values.flatten(-2).to(dtype)  # [..., groups * 32]


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks, scales)`` of ``weight [..., n]`` (n a multiple of 32), each group scaled by the power of
    two that brings its largest magnitude to at most 6 and every value rounded to the nearest E2M1
    code. Used to write MXFP4 test checkpoints; ``dequantize_mxfp4`` inverts it up to that rounding."""
    if weight.shape[-1] % GROUP:
        raise ValueError(
            f"MXFP4 needs the last dimension to be a multiple of {GROUP}, got {weight.shape[-1]}"
        )
    groups = weight.float().unflatten(-1, (-1, GROUP))  # [..., groups, 32]
    largest = groups.abs().amax(dim=-1).clamp(min=2.0**-126)  # [..., groups]
    exponents = torch.ceil(torch.log2(largest / 6.0)).clamp(-E8M0_BIAS, E8M0_BIAS)  # [..., groups]
    scaled = groups / torch.pow(2.0, exponents)[..., None]  # [..., groups, 32], |x| <= 6
    table = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)  # [16]
    codes = (scaled[..., None] - table).abs().argmin(dim=-1)  # [..., groups, 32] nearest code
    pairs = codes.unflatten(-1, (-1, 2))  # [..., groups, 16, 2]
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)  # [..., groups, 16]
    scales = (exponents + E8M0_BIAS).to(torch.uint8)  # [..., groups]
    return blocks, scales
