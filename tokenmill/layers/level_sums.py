"""Exact GGUF groups on the level-sums kernel: a Q4_K layer's 4-bit levels with float32 scales, and a
Q5_0 layer's 5-bit levels.

Both are, per group of 32 weights, ``scale * q + min`` with small levels ``q``, which the level-sums
kernel (``csrc/int4_pairs_cpu.cpp``, the op ``level_sums_linear``: AVX512-BF16, 1 to
``INT4_PAIRS_MAX_ROWS`` bfloat16 rows; the blocked kernel, below, up to ``INT4_BLOCKED_MAX_ROWS``)
multiplies as ``scale * sum(x q) + min * sum(x)``: with the exact values, from the levels' bits.

- Q4_K stores super-blocks of 256 weights: a float16 ``d`` and ``dmin``, and per sub-block of 32 a
  6-bit scale ``sc`` and minimum ``m``; a weight is ``d sc q - dmin m``. So ``scale = d * sc`` and
  ``min = -dmin * m``, which float32 holds exactly (17 significant bits at most) and float16 does
  not: int4's float16 format (layers/int4.py) cannot take these layers, and loaded in bfloat16 they
  stream 16 bits a weight. Here: 4.5 + 1 bits. The loader side (``loader/gguf_k4.py``) reads the
  groups from the file, as their bfloat16 values no longer tell them.
- Q5_0 is ``d (q - 16)``, q in 0..31, one float16 ``d`` per group: ``scale = d``, ``min = -16 d``
  (float16), and the fifth bit of each level in a 32-bit word per group (``high``). Such a layer is
  found from its bfloat16 values (``q8.exact_small_level_groups``, whose 8-bit copy it replaces):
  5.5 bits a weight instead of 8.5, and from 1 up to 8 (blocked: 16) rows instead of 1.

Without AMX tiles, a layer whose outputs are a multiple of 16 multiplies on the blocked kernel instead
(``csrc/int4_blocked_cpu.cpp``, through the same op) over a copy made on first use
(:meth:`LevelWeight.kernel_tensors`): the same exact values, 16 outputs a vector; and steps of more
rows on the wide kernel over that copy (``csrc/int4_wide_cpu.cpp``), which multiplies with the values
rounded to bfloat16, the layer's bfloat16 weight.

Levels are packed as int4 packs them (byte ``j`` of a group holds elements ``j`` and ``j + 16``). The
layer keeps its bfloat16 weight (the values rounded) for larger steps, other CPUs and the
deterministic mode: not a quantization, as with the exact 8-bit groups of layers/q8.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.layers.int4 import (
    INT4_PAIRS_MAX_ROWS,
    INT4_WIDE_MAX_ROWS,
    block_fifth_bits,
    block_int4_layout,
    blocked_copy,
    blocked_takes,
    float32_max_rows,
)

GROUP_SIZE = 32


@dataclass
class LevelWeight:
    """A weight's exact groups of small levels, for steps of 1 to ``max_rows`` rows."""

    packed: torch.Tensor  # [out_features, in_features / 2] uint8: the levels' low four bits
    scales: torch.Tensor  # [out_features, in_features / 32] float32 (Q4_K) or float16 (Q5_0)
    mins: torch.Tensor  # [out_features, in_features / 32] the scales' dtype
    high: torch.Tensor | None = None  # [out_features, in_features / 32] int32: the fifth bits (Q5_0)
    # Default: the blocked kernel's rows where it takes the weight, else the level-sums kernel's.
    max_rows: int = 0
    # The blocked kernel's copy (:meth:`kernel_tensors`), made on first use.
    _blocked: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None = field(
        default=None, repr=False, compare=False
    )
    # The most float32 rows a step takes the blocked kernel for float32 rows for: 4-bit levels whose
    # outputs it takes (int4.py blocked_f32_takes); else 0 (the float32 weight).
    float32_max_rows: int = field(init=False, default=0)
    # The same layout for float32 rows (:meth:`blocked_f32`), made on first use.
    _blocked_f32: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(
        default=None, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        out_features = self.packed.shape[0]
        if self.max_rows <= 0:
            self.max_rows = INT4_WIDE_MAX_ROWS if blocked_takes(out_features) else INT4_PAIRS_MAX_ROWS
        if self.high is None:
            self.float32_max_rows = float32_max_rows(out_features, otherwise=0)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through the kernels: 2-D bfloat16 with 1 to ``max_rows`` rows, or float32
        with 1 to ``float32_max_rows``."""
        if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32):
            return False
        return 0 < x.shape[0] <= (self.max_rows if x.dtype == torch.bfloat16 else self.float32_max_rows)

    def blocked_f32(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(packed, scales, mins)`` in the blocked layout for float32 rows
        (``csrc/int4_blocked_f32_cpu.cpp``, 4-bit levels only), or None where it does not serve."""
        if self.float32_max_rows == 0:
            return None
        if self._blocked_f32 is None:
            self._blocked_f32 = block_int4_layout(self.packed, self.scales, self.mins)
        return self._blocked_f32

    def kernel_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(packed, scales, mins, high)`` as ``level_sums_linear`` takes them: the blocked kernel's copy
        (``layers/int4.py`` ``block_int4_layout``) where that kernel runs and the outputs are a multiple
        of 16, else the level-sums kernel's row layout (this weight's own tensors)."""
        if (
            self._blocked is None
            and (blocked := blocked_copy(self.packed, self.scales, self.mins)) is not None
        ):
            self._blocked = (*blocked, None if self.high is None else block_fifth_bits(self.high))
        return self._blocked or (self.packed, self.scales, self.mins, self.high)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` ``[rows, out_features]`` in x's dtype (float32 sums): with the exact values, or on
        the wide kernel (bfloat16 steps above ``INT4_BLOCKED_MAX_ROWS`` rows) with the bfloat16 ones."""
        x = x if x.stride(1) == 1 else x.contiguous()
        if x.dtype == torch.float32 and (blocked := self.blocked_f32()) is not None:
            return torch.ops.tokenmill.level_sums_linear(x, *blocked, None)
        return torch.ops.tokenmill.level_sums_linear(x, *self.kernel_tensors())

    def levels(self) -> torch.Tensor:
        """The levels ``[out, in]`` uint8 (0..15, or 0..31 with fifth bits)."""
        levels = unpack_levels(self.packed)
        if self.high is None:
            return levels
        out_features = levels.shape[0]
        bits = torch.arange(GROUP_SIZE, dtype=torch.int32)  # [32]
        fifth = (self.high[..., None] >> bits) & 1  # [out, G, 32]
        return levels | (fifth.reshape(out_features, -1) << 4).to(torch.uint8)

    def dequantize(self) -> torch.Tensor:
        """The values ``scale * q + min`` ``[out, in]`` in float32 (product, then sum, each rounded to
        float32, as the GGUF dequantization does)."""
        out_features = self.packed.shape[0]
        levels = self.levels().reshape(out_features, -1, GROUP_SIZE).float()  # [out, G, 32]
        scales, mins = self.scales.float()[..., None], self.mins.float()[..., None]
        return (levels * scales + mins).reshape(out_features, -1)


def pack_levels(levels: torch.Tensor) -> torch.Tensor:
    """The low four bits of levels ``[out, in]`` (uint8) packed as layers/int4.py packs them:
    ``[out, in / 2]``."""
    out_features, in_features = levels.shape
    groups = (levels & 0x0F).reshape(out_features, in_features // GROUP_SIZE, 2, 16)  # [out, G, halves, 16]
    return (groups[:, :, 0] | (groups[:, :, 1] << 4)).reshape(out_features, in_features // 2)


def unpack_levels(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_levels`: ``[out, in]`` uint8 levels' low four bits."""
    out_features = packed.shape[0]
    groups = packed.reshape(out_features, -1, 1, 16)  # [out, G, 1, 16]
    return torch.cat([groups & 0x0F, groups >> 4], dim=2).reshape(out_features, -1)


def fifth_bits(levels: torch.Tensor) -> torch.Tensor:
    """Bit 4 of each level ``[out, in]`` (uint8, 0..31) as one int32 word per group ``[out, in / 32]``
    (bit ``j``: element ``j``'s)."""
    out_features = levels.shape[0]
    bits = ((levels >> 4) & 1).reshape(out_features, -1, GROUP_SIZE).to(torch.int64)  # [out, G, 32]
    words = (bits << torch.arange(GROUP_SIZE)).sum(dim=2)  # [out, G], 0 .. 2^32 - 1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def five_bit_weight(q: torch.Tensor, scales: torch.Tensor) -> LevelWeight | None:
    """The 5-bit form of exact 8-bit groups ``(q [out, in] int8, scales [out, in / 32] float16)``
    (layers/q8.py) whose levels all lie in -16..15 (a Q5_0 tensor's), else None: levels ``q + 16``,
    minimums ``-16 d`` (exact in float16). A group found with levels in -15..16 (the sign of its
    ``d`` is its finder's choice) is taken as ``(-d, -q)``."""
    if q.numel() == 0:
        return None
    out_features = q.shape[0]
    groups = q.to(torch.int16).reshape(out_features, -1, GROUP_SIZE)  # [out, G, 32]
    flip = groups.amax(dim=2) > 15  # [out, G]
    groups = torch.where(flip[..., None], -groups, groups)
    scales = torch.where(flip, -scales, scales)
    if int(groups.min()) < -16 or int(groups.max()) > 15:
        return None
    mins = scales * -16  # exact in float16 unless it overflows
    if not bool(torch.isfinite(mins).all()):
        return None
    levels = (groups + 16).to(torch.uint8).reshape(out_features, -1)  # [out, in], 0..31
    return LevelWeight(pack_levels(levels), scales, mins, fifth_bits(levels))
