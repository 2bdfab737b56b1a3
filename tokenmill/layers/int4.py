"""Weight-only int4 in groups of 32 (opt-in: ``--quantization int4``), with our own CPU kernel.

Format (the asymmetric one of GGUF's Q4_1): a weight ``[out, in]`` is cut into groups of 32
consecutive input features; each group has a float16 scale ``d`` and minimum ``m`` (tensors
``[out, in / 32]``) and 4-bit values ``q`` in 0..15 standing for ``d * q + m``. The 32 values of a
group are packed in 16 bytes: byte ``j`` holds element ``j`` in its low nibble and element ``j + 16``
in its high nibble. That is 4.5 bits per weight, 3.6x fewer bytes than bfloat16, and decoding a few
sequences is a stream over the weights.

Float32 rows (a float32 model, ``--dtype auto`` on CPUs without AVX512-BF16) multiply with the
unrounded values ``d * q + m``, which a Q4_1 GGUF's layers hold exactly in float32: on the blocked
copy below (``csrc/int4_blocked_f32_cpu.cpp``, AVX2 or AVX-512F: ``d * sum(x q) + m * sum(x)`` per
group, up to :func:`float32_max_rows` rows) where the outputs are a multiple of 16, else on the row
layout (``csrc/group_gemm_f32_cpu.cpp``, AVX2 FMA); the rest of this paragraph is about bfloat16 rows.
``int4_linear`` (``csrc/int4_gemm_cpu.cpp``) multiplies the rows of a step by such a weight, decoding
each packed byte once per call. On CPUs with AVX512-BF16 steps of 1 to 8 rows (below the tiles) take
the level-sums kernel (``csrc/int4_pairs_cpu.cpp``: per group ``d * sum(x q) + m * sum(x)``, two groups
per vector), which computes with the exact values ``d * q + m``; where the CPU has no AMX tiles, a
weight whose outputs are a multiple of 16 takes those steps, and those up to ``INT4_BLOCKED_MAX_ROWS``
rows, on the blocked kernel instead (``csrc/int4_blocked_cpu.cpp``: the same values over a copy laid out
for it, :func:`block_int4_layout`, 16 outputs a vector; on SmolLM2's shapes 1.2-1.4x the level sums'
speed at one row, 1.5-1.6x at five), and larger steps on the wide kernel over that copy
(``csrc/int4_wide_cpu.cpp``); the row kernel (one bfloat16 dot
product per row and group; method 1, the deterministic mode's), on CPUs with AMX the tile kernel
(each decoded 16 x 32 weight tile multiplied with 16 rows per tile product, from ``kTilesFromRows``
rows) and the wide kernel compute with ``round_bf16(d * q + m)`` (exact in float32 before the rounding),
the bfloat16 weight ``int4_dequantize`` gives, which steps above :func:`int4_max_rows` (where there is
such a bound) multiply with oneDNN's bfloat16 GEMM. The exact and the rounded values differ by the
weights' bfloat16 rounding, well within the format's own error.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from tokenmill.layers.cpu_kernels import load_error

GROUP_SIZE = 32

# Up to this many rows a step uses the int4 kernels; above it the packed bfloat16 GEMM on the
# dequantized weight is faster (benchmarks/int4_gemv.py, docs/performance.md). Without AMX only the
# row kernel runs, whose time grows with the rows (one bfloat16 dot-product instruction per row and
# group) while oneDNN's stays at its streaming time: on SmolLM2's shapes they cross between 8 and
# 16 rows. The tile kernel decodes the weights once and multiplies 16 rows per tile product: it
# stays ahead of oneDNN up to about 128 rows.
INT4_MAX_ROWS = 8
INT4_MAX_ROWS_WITH_TILES = 128
# Without AMX, where the blocked kernel runs (csrc/int4_blocked_cpu.cpp: 16 outputs a vector, rows in
# passes of up to 12 over each block's weights), it takes steps of up to this many rows: SmolLM2's four
# projections at 16 rows 187 us (passes of 8; 175-179 in passes of 8 and 8 with two chains of sums a row)
# against oneDNN's 301 on a 2-core Zen 5 (1.2x at 32, even at 64). On
# a Zen 4 (512-bit instructions in two passes) its gate_up, 97 us at 8 rows and ~9 us a row more,
# stays under oneDNN's 203 us at 8 rows up to 16; 32 was not measured there (docs/performance.md).
INT4_BLOCKED_MAX_ROWS = 16
# Larger bfloat16 steps take the wide kernel on the same copy (csrc/int4_wide_cpu.cpp: each panel of 32
# outputs decoded once to bfloat16, tiles of 12 rows), for any number of rows. SmolLM2's four projections,
# 30 layers' weights streamed from memory as in a decode step, 2-core Zen 5, microseconds a layer, wide /
# blocked / oneDNN on the dequantized weight: 17 rows 217 / 209 / 301, 32 rows 306 / 360 / 419, 64 rows 535 /
# 667 / 702, 256 rows 1,853 / 2,622 / 2,034, 2,048 rows 14,983 / 22,488 / 15,461 (docs/performance.md).
INT4_WIDE_MAX_ROWS = 1 << 30
# float32 rows (csrc/group_gemm_f32_cpu.cpp) against float32 panels, SmolLM2's projections and head
# on one thread of a loaded Zen 4 on the avx2 path: 2.1x faster at one row, even at four.
INT4_FLOAT32_MAX_ROWS = 3
# float32 rows on the blocked copy (csrc/int4_blocked_f32_cpu.cpp), by the kernel's vector width.
# SmolLM2's four projections, 2-core Zen 5, benchmarks/int4_gemv.py --float32, microseconds, blocked /
# row kernel / float32 weight (our panels on avx2, oneDNN on avx512): 8 lanes (avx2) 88 / 112 / 332 at
# one row, 308 / 315 / 408 at eight, 686 / 657 / 588 at sixteen; 16 lanes (avx512) 75 / 134 / 322 at
# one row, 195 / 398 / 411 at eight, 361 / 787 / 511 at sixteen.
INT4_BLOCKED_F32_MAX_ROWS = {8: 8, 16: 16}

# int4_linear's ``method``: 0 picks by the number of rows, 1 forces the row kernel, 2 the tile kernel,
# 3 the level-sums kernel (csrc/int4_pairs_cpu.cpp: AVX512-BF16, 1 to INT4_PAIRS_MAX_ROWS rows).
METHOD_AUTO, METHOD_ROWS, METHOD_TILES, METHOD_PAIRS = 0, 1, 2, 3
INT4_PAIRS_MAX_ROWS = 8  # csrc/int4_pairs_cpu.cpp kMaxPairRows (the op int4_pairs_max_rows)

_FLOAT16_MAX = 65504.0
# The kernel keeps one weight row's scales and minimums in float32 on the stack (kMaxGroups groups).
MAX_IN_FEATURES = 1024 * GROUP_SIZE


def int4_supported(weight: torch.Tensor) -> str | None:
    """None when ``weight`` ``[out, in]`` can be stored as int4, else why not (for the load log)."""
    if weight.dim() != 2 or weight.shape[1] % GROUP_SIZE:
        return f"in_features {weight.shape[-1]} is not a multiple of {GROUP_SIZE}"
    if weight.shape[1] > MAX_IN_FEATURES:
        return f"in_features {weight.shape[1]} is above the kernel's {MAX_IN_FEATURES}"
    largest = float(weight.abs().max())
    if not largest <= _FLOAT16_MAX:  # also NaN
        return "values exceed the float16 range of the scales (or are not finite)"
    return None


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed [out, in/2] uint8, scales [out, in/32] float16, mins [out, in/32] float16)``.

    Per group: ``m`` is the group's minimum (rounded to float16), ``d = (max - m) / 15`` (rounded to
    float16), ``q = round((w - m) / d)`` clamped to 0..15. A constant group gets ``d = 0`` and ``q = 0``
    (every value is ``m``). ``in_features`` must be a multiple of 32 (see :func:`int4_supported`).
    """
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)  # [out, G, 32]
    mins = groups.amin(dim=2).to(torch.float16)  # [out, G]
    scales = ((groups.amax(dim=2) - mins.float()) / 15.0).to(torch.float16)  # [out, G]
    # Divide by the rounded scale: the values are rebuilt from it.
    step = torch.where(scales > 0, scales.float(), torch.ones_like(scales, dtype=torch.float32))
    q = torch.round((groups - mins.float()[..., None]) / step[..., None]).clamp(0, 15)  # [out, G, 32]
    q = torch.where(scales[..., None] > 0, q, torch.zeros_like(q)).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)  # [out, G, 16]
    return packed.reshape(out_features, in_features // 2), scales, mins


def dequantize_int4_reference(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The weight ``[out, in]`` in bfloat16 from torch ops (the formula the kernel uses, for tests)."""
    out_features = packed.shape[0]
    groups = packed.reshape(out_features, -1, GROUP_SIZE // 2)  # [out, G, 16]
    q = torch.cat([groups & 0x0F, groups >> 4], dim=2).float()  # [out, G, 32]
    values = q * scales.float()[..., None] + mins.float()[..., None]  # q * d is exact in float32
    return values.to(torch.bfloat16).reshape(out_features, -1)


def _require_kernel() -> None:
    """RuntimeError when the C++ kernels cannot be built or loaded (``load_error`` caches the build)."""
    error = load_error()
    if error is not None:
        raise RuntimeError(f"quantization 'int4' needs the C++ CPU kernels, which are unavailable: {error}")


@functools.cache
def int4_has_tiles() -> bool:
    """Whether the tile (AMX) kernel runs here: the CPU has AMX and the OS grants it to the process."""
    _require_kernel()
    return bool(torch.ops.tokenmill.int4_has_tiles())


@functools.cache
def int4_blocked_available() -> bool:
    """Whether the blocked kernel is built here (AVX512-BF16) and takes small steps: no AMX tiles,
    which take steps from ``kTilesFromRows`` rows (the blocked kernel is for every step of 1 to
    ``INT4_BLOCKED_MAX_ROWS`` rows, so that a row's bits never depend on the step's row count there)."""
    _require_kernel()
    return bool(torch.ops.tokenmill.int4_blocked_available()) and not int4_has_tiles()


BLOCK_OUTPUTS = 16  # csrc/int4_blocked_cpu.cpp kBlockOutputs


def block_int4_layout(
    packed: torch.Tensor,  # [out_features, in_features / 2] uint8
    scales: torch.Tensor,  # [out_features, in_features / 32] float16 (float32: layers/level_sums.py)
    mins: torch.Tensor,  # [out_features, in_features / 32] the scales' dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same weight in the blocked kernel's layout (``csrc/int4_blocked_cpu.cpp``): ``packed``
    ``[out / 16, G, 256]`` uint8, where per block of 16 outputs and group, step ``t`` (features
    ``4t .. 4t + 3``) is 32 bytes, byte ``j`` holding output ``j // 2``'s level of feature ``4t + j % 2``
    in its low nibble and of feature ``4t + 2 + j % 2`` in its high one; ``scales`` and ``mins``
    ``[out / 16, G, 16]``. ``out_features`` must be a multiple of 16 (ValueError). For 5-bit levels
    :func:`block_fifth_bits` lays out their fifth bits to match."""
    out_features, half_in = packed.shape
    if out_features % BLOCK_OUTPUTS:
        raise ValueError(
            f"the blocked int4 layout needs out_features a multiple of {BLOCK_OUTPUTS}, got {out_features}"
        )
    groups = half_in * 2 // GROUP_SIZE
    blocks = out_features // BLOCK_OUTPUTS
    grouped = packed.reshape(out_features, groups, GROUP_SIZE // 2)  # [out, G, 16]
    levels = torch.cat([grouped & 0x0F, grouped >> 4], dim=2)  # [out, G, 32]: element order
    steps = levels.reshape(blocks, BLOCK_OUTPUTS, groups, GROUP_SIZE // 4, 4)  # [B, 16, G, 8, 4]
    steps = steps.permute(0, 2, 3, 1, 4)  # [B, G, 8, 16 outputs, 4 features]
    bytes_ = steps[..., :2] | (steps[..., 2:] << 4)  # [B, G, 8, 16, 2]
    blocked = bytes_.reshape(blocks, groups, 8 * GROUP_SIZE).contiguous()  # [B, G, 256]

    def by_block(values: torch.Tensor) -> torch.Tensor:
        return values.reshape(blocks, BLOCK_OUTPUTS, groups).transpose(1, 2).contiguous()  # [B, G, 16]

    return blocked, by_block(scales), by_block(mins)


def blocked_copy(
    packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`block_int4_layout` of a weight whose small bfloat16 steps the blocked kernel takes (it runs
    here, :func:`int4_blocked_available`, and the outputs are a multiple of 16), else None."""
    if not blocked_takes(packed.shape[0]):
        return None
    return block_int4_layout(packed, scales, mins)


@functools.cache
def int4_blocked_f32_lanes() -> int:
    """The float32 blocked kernel's outputs per vector here: 16 (AVX-512F), 8 (AVX2, FMA and F16C) or
    0 (not built: float32 rows take the row kernel)."""
    _require_kernel()
    return int(torch.ops.tokenmill.int4_blocked_f32_lanes())


def blocked_f32_takes(out_features: int) -> bool:
    """Whether the blocked kernels for float32 rows run here and take a weight with ``out_features``
    outputs (a multiple of 16): then they take float32 steps of 1 to ``INT4_BLOCKED_F32_MAX_ROWS``
    rows for their vector width."""
    return out_features % BLOCK_OUTPUTS == 0 and load_error() is None and int4_blocked_f32_lanes() > 0


def float32_max_rows(out_features: int, otherwise: int = INT4_FLOAT32_MAX_ROWS) -> int:
    """The most float32 rows a step sends through the kernels for a weight with ``out_features``
    outputs: the blocked kernels' bound for their vector width where they take the weight
    (:func:`blocked_f32_takes`), else ``otherwise`` (int4's row kernel bound by default; q8 passes its
    own, a weight without a row kernel 0)."""
    if blocked_f32_takes(out_features):
        return INT4_BLOCKED_F32_MAX_ROWS[int4_blocked_f32_lanes()]
    return otherwise


def blocked_takes(out_features: int) -> bool:
    """Whether the blocked kernel runs here and takes a weight with ``out_features`` outputs (a multiple
    of 16): then it takes bfloat16 steps of 1 to ``INT4_BLOCKED_MAX_ROWS`` rows, and the wide kernel
    larger ones."""
    return out_features % BLOCK_OUTPUTS == 0 and load_error() is None and int4_blocked_available()


def block_fifth_bits(high: torch.Tensor) -> torch.Tensor:
    """Fifth bits ``[out, G]`` int32 (bit ``j``: element ``j`` of the group, layers/level_sums.py) in the
    blocked layout: ``[out / 16, G, 16]`` int32, per block, group and step ``t`` two masks whose bit
    ``j`` is the fifth bit of the level in byte ``j``'s low nibble, then its high nibble."""
    out_features, groups = high.shape
    blocks = out_features // BLOCK_OUTPUTS
    bits = (high[..., None].long() >> torch.arange(GROUP_SIZE)) & 1  # [out, G, 32]
    steps = bits.reshape(blocks, BLOCK_OUTPUTS, groups, GROUP_SIZE // 4, 4).permute(
        0, 2, 3, 1, 4
    )  # [B, G, 8, 16, 4]
    weights = 1 << torch.arange(GROUP_SIZE)  # bit j of a mask: byte j = output j // 2, feature parity j % 2
    masks = torch.stack(
        [
            (steps[..., :2].reshape(blocks, groups, 8, GROUP_SIZE) * weights).sum(-1),
            (steps[..., 2:].reshape(blocks, groups, 8, GROUP_SIZE) * weights).sum(-1),
        ],
        dim=-1,
    )  # [B, G, 8, 2] in 0 .. 2^32 - 1
    masks = torch.where(masks >= 1 << 31, masks - (1 << 32), masks)  # the same bits as int32
    return masks.reshape(blocks, groups, 2 * (GROUP_SIZE // 4)).to(torch.int32).contiguous()


@functools.cache
def int4_pairs_available() -> bool:
    """Whether the level-sums kernel is built here (AVX512-BF16: the avx512_bf16 and amx paths)."""
    _require_kernel()
    return bool(torch.ops.tokenmill.int4_pairs_available())


def int4_max_rows(out_features: int) -> int:
    """The most rows a step sends through the int4 kernels on this machine for a weight with
    ``out_features`` outputs (see ``INT4_MAX_ROWS``): the tiles', any number where the blocked and wide
    kernels take the weight (:func:`blocked_takes`), else the row kernels'."""
    if int4_has_tiles():
        return INT4_MAX_ROWS_WITH_TILES
    if blocked_takes(out_features):
        return INT4_WIDE_MAX_ROWS
    return INT4_MAX_ROWS


def int4_dequantize(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The bfloat16 weight ``[out, in]`` that :func:`int4_linear` computes with (kernel op)."""
    _require_kernel()
    return torch.ops.tokenmill.int4_dequantize(packed, scales, mins)


def int4_linear(
    x: torch.Tensor,  # [rows, in_features] bfloat16
    packed: torch.Tensor,  # [out_features, in_features / 2] uint8
    scales: torch.Tensor,  # [out_features, in_features / 32] float16
    mins: torch.Tensor,  # [out_features, in_features / 32] float16
    bias: torch.Tensor | None,
    method: int = METHOD_AUTO,
) -> torch.Tensor:
    """``x @ W.T + bias`` for the int4 weight ``W`` (float32 accumulation); ``[rows, out_features]``.
    ``method`` forces a kernel (``METHOD_ROWS``, ``METHOD_TILES``: RuntimeError without AMX)."""
    _require_kernel()
    out = torch.ops.tokenmill.int4_linear(x, packed, scales, mins, method)  # [rows, out_features]
    return out if bias is None else out + bias


@dataclass
class Int4Weight:
    """One layer's int4 weight (see the module docstring for the format)."""

    packed: torch.Tensor  # [out_features, in_features / 2] uint8
    scales: torch.Tensor  # [out_features, in_features / 32] float16
    mins: torch.Tensor  # [out_features, in_features / 32] float16
    # The most rows a bfloat16 step takes the int4 kernels for (default: :func:`int4_max_rows`).
    max_rows: int = 0
    # The most rows a float32 step takes them for (default: :func:`float32_max_rows`).
    float32_max_rows: int = 0
    # The blocked layout (:meth:`blocked`, :meth:`blocked_f32`), made on first use.
    _blocked: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(
        default=None, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if self.max_rows <= 0:
            self.max_rows = int4_max_rows(self.packed.shape[0])
        if self.float32_max_rows <= 0:
            self.float32_max_rows = float32_max_rows(self.packed.shape[0])

    def _layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._blocked is None:
            self._blocked = block_int4_layout(self.packed, self.scales, self.mins)
        return self._blocked

    def blocked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(packed, scales, mins)`` in the blocked layout for bfloat16 steps of 1 to ``max_rows`` rows
        (the blocked kernel up to ``INT4_BLOCKED_MAX_ROWS``, the wide one above) where those kernels run
        (:func:`int4_blocked_available`) and the outputs are a multiple of 16, else None (those steps take
        the level-sums or row kernel)."""
        return self._layout() if blocked_takes(self.packed.shape[0]) else None

    def blocked_f32(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The same layout for float32 steps of 1 to ``float32_max_rows`` rows where the float32 blocked
        kernel runs (:func:`int4_blocked_f32_lanes`) and the outputs are a multiple of 16, else None
        (those steps take the row kernel, ``csrc/group_gemm_f32_cpu.cpp``)."""
        return self._layout() if blocked_f32_takes(self.packed.shape[0]) else None

    def triple(self, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tensors ``int4_linear`` multiplies a step of ``rows`` rows of ``dtype`` with (auto method):
        the blocked copy for the steps its kernels take, else the row layout."""
        if dtype == torch.bfloat16 and rows <= self.max_rows and (blocked := self.blocked()) is not None:
            return blocked
        if (
            dtype == torch.float32
            and rows <= self.float32_max_rows
            and (blocked := self.blocked_f32()) is not None
        ):
            return blocked
        return self.packed, self.scales, self.mins

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through the int4 kernels: 2-D bfloat16 or float32 (a float32 model's exactly
        4-bit layers: ``csrc/int4_blocked_f32_cpu.cpp``, else ``csrc/group_gemm_f32_cpu.cpp``) with 1 to
        ``max_rows`` rows (float32: 1 to ``float32_max_rows``)."""
        if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32):
            return False
        return 0 < x.shape[0] <= (self.max_rows if x.dtype == torch.bfloat16 else self.float32_max_rows)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` with the int4 kernel; ``[rows, out_features]``. (An ``Int4Weight`` exists
        only once the kernels have loaded, so this skips :func:`int4_linear`'s check: it runs 121 times
        per decode step of SmolLM2.)"""
        packed, scales, mins = self.triple(x.shape[0], x.dtype)
        out = torch.ops.tokenmill.int4_linear(x, packed, scales, mins)  # [rows, out_features]
        return out if bias is None else out + bias


def quantize_int4_weight(
    weight: torch.Tensor,
) -> tuple[Int4Weight | None, torch.Tensor | None, str | None]:
    """``(int4 weight, the weight it computes with, None)`` for a supported ``weight`` ``[out, in]``,
    else ``(None, None, why not)``. The weight it computes with is bfloat16, or for a float32 ``weight``
    float32 (``d * q + m`` unrounded: the values float32 rows meet in the kernel). Raises RuntimeError
    when the kernels cannot be built (int4 has no slow fallback)."""
    reason = int4_supported(weight)
    if reason is not None:
        return None, None, reason
    packed, scales, mins = quantize_int4(weight)
    if weight.dtype == torch.float32:
        _require_kernel()
        return Int4Weight(packed, scales, mins), dequantize_int4_float32(packed, scales, mins), None
    return Int4Weight(packed, scales, mins), int4_dequantize(packed, scales, mins), None


def dequantize_int4_float32(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The float32 weight ``[out, in]`` that float32 rows multiply with: ``q * d + m`` with one rounding
    (``q * d`` is exact in float32), the values a Q4_1 GGUF tensor dequantizes to."""
    out_features = packed.shape[0]
    groups = packed.reshape(out_features, -1, GROUP_SIZE // 2)  # [out, G, 16]
    q = torch.cat([groups & 0x0F, groups >> 4], dim=2).float()  # [out, G, 32]
    return (q * scales.float()[..., None] + mins.float()[..., None]).reshape(out_features, -1)
