"""The blocked int4 kernel (``csrc/int4_blocked_cpu.cpp``) over its copy of an int4 weight
(``layers/int4.py`` ``block_int4_layout``): the layout holds the same levels and constants, the
kernel computes with the exact values ``d * q + m``, a row's bits do not depend on the step's rows,
and ``Int4Weight`` sends bfloat16 steps of 1 to ``INT4_BLOCKED_MAX_ROWS`` rows to it (larger ones to the
wide kernel over the same copy: test_int4_wide.py); ``LevelWeight`` (GGUF Q4_K / Q5_0 groups) too."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.int4 import (
    BLOCK_OUTPUTS,
    INT4_BLOCKED_MAX_ROWS,
    INT4_PAIRS_MAX_ROWS,
    INT4_WIDE_MAX_ROWS,
    METHOD_ROWS,
    Int4Weight,
    block_int4_layout,
    dequantize_int4_float32,
    int4_blocked_available,
    int4_linear,
    quantize_int4,
)
from tokenmill.layers.level_sums import LevelWeight, pack_levels

BF16 = torch.bfloat16
needs_kernel = pytest.mark.skipif(
    not int4_blocked_available(), reason="the blocked kernel needs AVX512-BF16 and no AMX tiles"
)


def levels_of(packed: torch.Tensor) -> torch.Tensor:
    """The row layout's levels ``[out, in]`` in feature order."""
    grouped = packed.reshape(packed.shape[0], -1, 16)  # [out, G, 16]
    return torch.cat([grouped & 0x0F, grouped >> 4], dim=2).reshape(packed.shape[0], -1)


def test_the_blocked_layout_holds_each_level_where_the_kernel_reads_it() -> None:
    out_features, in_features = 48, 96
    packed, scales, mins = quantize_int4(torch.randn(out_features, in_features))
    blocked, block_scales, block_mins = block_int4_layout(packed, scales, mins)
    groups = in_features // 32
    assert blocked.shape == (out_features // BLOCK_OUTPUTS, groups, 256) and blocked.dtype == torch.uint8
    assert block_scales.shape == block_mins.shape == (out_features // BLOCK_OUTPUTS, groups, BLOCK_OUTPUTS)
    levels = levels_of(packed)
    for o, feature in [(0, 0), (17, 5), (47, 95), (30, 34), (5, 66)]:
        b, lane = divmod(o, BLOCK_OUTPUTS)
        g, within = divmod(feature, 32)
        t, e = divmod(within, 4)  # step t: features 4t .. 4t + 3
        byte = int(blocked[b, g, t * 32 + 2 * lane + e % 2])
        assert (byte >> 4 if e >= 2 else byte & 0x0F) == int(levels[o, feature])
        assert block_scales[b, g, lane] == scales[o, g] and block_mins[b, g, lane] == mins[o, g]
    with pytest.raises(ValueError, match="needs out_features a multiple of 16, got 40"):
        block_int4_layout(*quantize_int4(torch.randn(40, 64)))


@needs_kernel
@pytest.mark.parametrize("shape", [(960, 576), (16, 32), (48, 96), (576, 1536), (64, 544)])
def test_the_blocked_kernel_computes_with_the_exact_weight_values(shape: tuple[int, int]) -> None:
    """d * sum(x q) + m * sum(x) per group, float32 sums, one bfloat16 rounding; every row count from 1
    to the kernel's bound (two passes of 8 rows over a block) gives each row the bits it has alone."""
    out_features, in_features = shape
    packed, scales, mins = quantize_int4(torch.randn(shape) / in_features**0.5 + 0.01)
    weight = Int4Weight(packed, scales, mins)
    blocked = weight.blocked()
    assert blocked is not None
    exact_weight = dequantize_int4_float32(packed, scales, mins).double()  # [out, in]
    x_all = torch.randn(INT4_BLOCKED_MAX_ROWS, in_features, dtype=BF16)
    alone = [
        torch.ops.tokenmill.int4_linear(x_all[r : r + 1], *blocked) for r in range(INT4_BLOCKED_MAX_ROWS)
    ]
    assert INT4_BLOCKED_MAX_ROWS == torch.ops.tokenmill.int4_blocked_max_rows() == 16
    for rows in range(1, INT4_BLOCKED_MAX_ROWS + 1):
        x = x_all[:rows]
        got = torch.ops.tokenmill.int4_linear(x, *blocked)  # [rows, out]
        assert got.dtype == BF16 and got.shape == (rows, out_features)
        assert torch.equal(weight.linear(x, None), got)  # the module's choice
        for r in range(rows):
            assert torch.equal(got[r : r + 1], alone[r]), (rows, r)
        exact = x.double() @ exact_weight.T
        magnitude = x.double().abs() @ exact_weight.abs().T
        error = (got.double() - exact).abs()
        assert bool((error <= 2**-8 * exact.abs() + 2**-16 * magnitude).all()), rows


@needs_kernel
def test_int4_weights_use_the_blocked_copy_for_every_bfloat16_step() -> None:
    packed, scales, mins = quantize_int4(torch.randn(32, 64))
    weight = Int4Weight(packed, scales, mins)
    blocked = weight.blocked()
    assert blocked is not None and weight.blocked() is blocked  # made once
    assert weight.max_rows == INT4_WIDE_MAX_ROWS
    assert weight.triple(INT4_BLOCKED_MAX_ROWS, BF16) is blocked
    assert weight.triple(INT4_BLOCKED_MAX_ROWS + 1, BF16) is blocked  # the wide kernel's steps
    assert weight.triple(weight.float32_max_rows + 1, torch.float32) == (packed, scales, mins)
    x = torch.randn(weight.float32_max_rows + 1, 64)
    # Float32 rows above the float32 kernels' bound: the row layout's kernel.
    assert torch.equal(weight.linear(x, None), int4_linear(x, packed, scales, mins, None))
    uneven = Int4Weight(*quantize_int4(torch.randn(40, 64)))
    assert uneven.blocked() is None and uneven.triple(1, BF16)[0] is uneven.packed
    assert uneven.max_rows == INT4_PAIRS_MAX_ROWS  # the level-sums kernel's steps


@needs_kernel
def test_the_blocked_kernel_refuses_what_it_does_not_take() -> None:
    packed, scales, mins = quantize_int4(torch.randn(32, 64))
    blocked = block_int4_layout(packed, scales, mins)
    x = torch.randn(2, 64, dtype=BF16)
    with pytest.raises(RuntimeError, match="takes at least one row, got 0"):
        torch.ops.tokenmill.int4_linear(x[:0], *blocked)
    with pytest.raises(RuntimeError, match="runs on the blocked kernel only"):
        torch.ops.tokenmill.int4_linear(x[:1], *blocked, METHOD_ROWS)
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        torch.ops.tokenmill.int4_linear(x[:1, :32], *blocked)
    with pytest.raises(RuntimeError, match="takes a bfloat16 or float32 CPU tensor"):
        torch.ops.tokenmill.int4_linear(x[:1].half(), *blocked)
    with pytest.raises(RuntimeError, match="scales and mins must be contiguous float16"):
        torch.ops.tokenmill.int4_linear(x[:1], blocked[0], blocked[1].float(), blocked[2])


def level_weight(out_features: int, in_features: int, five: bool, seed: int) -> LevelWeight:
    """Random levels (0..15, or 0..31 with fifth bits) with float32 scales and minimums (Q4_K's kind)
    or, for 5-bit levels, float16 ones (Q5_0's)."""
    generator = torch.Generator().manual_seed(seed)
    levels = torch.randint(0, 32 if five else 16, (out_features, in_features), generator=generator).to(
        torch.uint8
    )
    groups = in_features // 32
    scales = torch.rand(out_features, groups, generator=generator) * 1e-2 + 1e-3
    mins = -torch.rand(out_features, groups, generator=generator) * 5e-2
    high = None
    if five:
        bits = (levels >> 4).reshape(out_features, groups, 32).long() << torch.arange(32)  # [out, G, 32]
        words = bits.sum(-1)
        high = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
        scales, mins = scales.half(), mins.half()
    return LevelWeight(pack_levels(levels), scales, mins, high)


@needs_kernel
@pytest.mark.parametrize("five", [False, True])
def test_gguf_level_groups_take_the_blocked_kernel_with_their_exact_values(five: bool) -> None:
    """layers/level_sums.py's groups (float32 scales, or 5-bit levels with their fifth bits laid out by
    ``block_fifth_bits``) on the blocked kernel: the exact values, each row's bits its own, close to the
    level-sums kernel on the row layout."""
    weight = level_weight(48, 96, five, seed=7)
    packed, scales, mins, high = weight.kernel_tensors()
    assert packed.dim() == 3 and (high is not None) == five
    exact_weight = weight.dequantize().double()  # [out, in]
    assert weight.max_rows == INT4_WIDE_MAX_ROWS
    x_all = torch.randn(INT4_BLOCKED_MAX_ROWS, 96, dtype=BF16)
    for rows in range(1, INT4_BLOCKED_MAX_ROWS + 1):
        x = x_all[:rows]
        got = weight.linear(x)
        for r in range(rows):
            assert torch.equal(got[r : r + 1], weight.linear(x_all[r : r + 1])), (rows, r)
        exact = x.double() @ exact_weight.T
        magnitude = x.double().abs() @ exact_weight.abs().T
        assert bool(((got.double() - exact).abs() <= 2**-8 * exact.abs() + 2**-16 * magnitude).all()), rows
        if rows > INT4_PAIRS_MAX_ROWS:
            continue
        pairs = torch.ops.tokenmill.level_sums_linear(
            x, weight.packed, weight.scales, weight.mins, weight.high
        )
        assert torch.allclose(got.float(), pairs.float(), rtol=2**-7, atol=1e-3)
    uneven = level_weight(40, 64, five, seed=8)
    assert uneven.kernel_tensors()[0] is uneven.packed  # 40 outputs: the row layout
    assert uneven.max_rows == INT4_PAIRS_MAX_ROWS
