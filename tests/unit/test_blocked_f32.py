"""The blocked kernels for float32 rows: int4 (``csrc/int4_blocked_f32_cpu.cpp``, over the same blocked
copy as the bfloat16 kernel) and exact 8-bit groups (``csrc/q8_blocked_f32_cpu.cpp``, the head of a
float32 model). They compute with the exact values ``d * q + m`` / ``d * q`` in float32, a row's bits
do not depend on the step's rows, and ``Int4Weight`` / ``Q8Weight`` send float32 steps of 1 to
``float32_max_rows`` rows to them. The AVX-512 build (16 outputs a vector) runs here; the AVX2 build (8 outputs a vector, an
AVX2-only CPU's) runs the same tests in a process under ``TOKENMILL_CPU_ISA=avx2``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tokenmill.layers.cpu_isa import cpu_flags, cpu_isa
from tokenmill.layers.int4 import (
    INT4_BLOCKED_F32_MAX_ROWS,
    INT4_FLOAT32_MAX_ROWS,
    Int4Weight,
    block_int4_layout,
    dequantize_int4_float32,
    int4_blocked_f32_lanes,
    quantize_int4,
)
from tokenmill.layers.q8 import Q8_FLOAT32_MAX_ROWS, Q8Weight, block_q8_layout

needs_kernel = pytest.mark.skipif(int4_blocked_f32_lanes() == 0, reason="the kernel needs AVX2, FMA and F16C")


@needs_kernel
@pytest.mark.parametrize("shape", [(960, 576), (16, 32), (48, 96), (576, 1536), (64, 544)])
def test_float32_rows_meet_the_exact_weight_values(shape: tuple[int, int]) -> None:
    """d * sum(x q) + m * sum(x) per group in float32 against the float64 product with the exact
    weights; every row count from 1 to past two passes over a block (and a larger step) gives each
    row the bits it has alone."""
    out_features, in_features = shape
    packed, scales, mins = quantize_int4(torch.randn(shape) / in_features**0.5 + 0.01)
    weight = Int4Weight(packed, scales, mins)
    blocked = weight.blocked_f32()
    assert blocked is not None
    exact_weight = dequantize_int4_float32(packed, scales, mins).double()  # [out, in]
    x_all = torch.randn(27, in_features)
    alone = [torch.ops.tokenmill.int4_linear(x_all[r : r + 1], *blocked) for r in range(27)]
    assert weight.float32_max_rows == INT4_BLOCKED_F32_MAX_ROWS[int4_blocked_f32_lanes()]
    for rows in [*range(1, 18), 27]:
        x = x_all[:rows]
        got = torch.ops.tokenmill.int4_linear(x, *blocked)  # [rows, out]
        assert got.dtype == torch.float32 and got.shape == (rows, out_features)
        if rows <= weight.float32_max_rows:
            assert torch.equal(weight.linear(x, None), got)  # the module's choice
        for r in range(rows):
            assert torch.equal(got[r : r + 1], alone[r]), (rows, r)
        exact = x.double() @ exact_weight.T
        magnitude = x.double().abs() @ exact_weight.abs().T
        error = (got.double() - exact).abs()
        assert bool((error <= 2**-20 * magnitude).all()), (rows, float((error / magnitude).max()))


@needs_kernel
def test_tiny_and_large_activations_keep_their_products() -> None:
    """Each feature's activation is divided by 16^k (k = its nibble in the word) before its product:
    exact for activations as small as 1e-30 and as large as 1e30."""
    packed, scales, mins = quantize_int4(torch.randn(32, 64))
    weight = Int4Weight(packed, scales, mins)
    blocked = weight.blocked_f32()
    assert blocked is not None
    exact_weight = dequantize_int4_float32(packed, scales, mins).double()
    for magnitude in (1e-30, 1.0, 1e30):
        x = torch.randn(3, 64) * magnitude
        got = torch.ops.tokenmill.int4_linear(x, *blocked).double()
        exact = x.double() @ exact_weight.T
        bound = 2**-20 * (x.double().abs() @ exact_weight.abs().T)
        assert bool(((got - exact).abs() <= bound).all()), magnitude


@needs_kernel
def test_int4_weights_send_small_float32_steps_to_the_blocked_copy() -> None:
    packed, scales, mins = quantize_int4(torch.randn(32, 64))
    weight = Int4Weight(packed, scales, mins)
    blocked = weight.blocked_f32()
    assert blocked is not None and weight.blocked_f32() is blocked  # made once
    top = weight.float32_max_rows
    assert weight.triple(top, torch.float32) is blocked
    assert weight.triple(top + 1, torch.float32) == (packed, scales, mins)
    assert weight.takes(torch.randn(top, 64)) and not weight.takes(torch.randn(top + 1, 64))
    # Outputs that are not a multiple of 16: the row kernel, for its own few rows.
    uneven = Int4Weight(*quantize_int4(torch.randn(40, 64)))
    assert uneven.blocked_f32() is None and uneven.triple(1, torch.float32)[0] is uneven.packed
    assert uneven.float32_max_rows == INT4_FLOAT32_MAX_ROWS


@needs_kernel
def test_the_float32_kernel_refuses_what_it_does_not_take() -> None:
    packed, scales, mins = quantize_int4(torch.randn(32, 64))
    blocked = block_int4_layout(packed, scales, mins)
    with pytest.raises(RuntimeError, match="takes a bfloat16 or float32 CPU tensor"):
        torch.ops.tokenmill.int4_linear(torch.randn(1, 64, dtype=torch.float64), *blocked)
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        torch.ops.tokenmill.int4_linear(torch.randn(1, 32), *blocked)
    high = torch.zeros(2, 2, 16, dtype=torch.int32)  # fifth bits in the blocked layout (Q5_0's groups)
    with pytest.raises(RuntimeError, match="takes 5-bit levels with bfloat16 rows only"):
        torch.ops.tokenmill.level_sums_linear(torch.randn(1, 64), *blocked, high)


def test_the_kernels_width_follows_the_path() -> None:
    """16 outputs a vector where the path has AVX-512F, 8 on the avx2 path (and an AVX2-only CPU)."""
    wide = cpu_isa() in ("amx", "avx512_bf16", "avx512")
    assert int4_blocked_f32_lanes() == (16 if wide else 8 if {"avx2", "fma", "f16c"} <= cpu_flags() else 0)


def q8_groups(out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
    scales = (torch.rand(out_features, in_features // 32) * 1e-2).half()
    scales[0, 0] = 0  # an all-zero group
    return q, scales


def test_the_blocked_q8_layout_holds_each_level_where_the_kernel_reads_it() -> None:
    q, scales = q8_groups(48, 96)
    blocked, block_scales = block_q8_layout(q, scales)
    assert blocked.shape == (3, 3, 512) and block_scales.shape == (3, 3, 16)
    for o, feature in [(0, 0), (17, 5), (47, 95), (30, 34)]:
        b, lane = divmod(o, 16)
        g, j = divmod(feature, 32)
        assert blocked[b, g, j * 16 + lane] == q[o, feature] and block_scales[b, g, lane] == scales[o, g]
    with pytest.raises(ValueError, match="needs out_features a multiple of 16, got 40"):
        block_q8_layout(*q8_groups(40, 64))


@needs_kernel
@pytest.mark.parametrize("shape", [(49152, 576), (48, 96)])
def test_float32_rows_meet_the_exact_q8_values(shape: tuple[int, int]) -> None:
    """d * sum(x q) per group in float32 against the float64 product; each row's bits as alone, for
    every row count to past two passes; the module sends its float32 steps there."""
    q, scales = q8_groups(*shape)
    weight = Q8Weight(q, scales)
    blocked = weight.blocked_f32()
    assert blocked is not None and weight.blocked_f32() is blocked
    exact = (q.double().reshape(shape[0], -1, 32) * scales.double()[..., None]).reshape(shape)
    x_all = torch.randn(19, shape[1])
    alone = [torch.ops.tokenmill.q8_linear(x_all[r : r + 1], *blocked) for r in range(19)]
    for rows in (1, 2, 3, 4, 5, 8, 9, 17, 19):
        x = x_all[:rows]
        got = torch.ops.tokenmill.q8_linear(x, *blocked)
        for r in range(rows):
            assert torch.equal(got[r : r + 1], alone[r]), (rows, r)
        if rows <= weight.float32_max_rows:
            assert torch.equal(weight.linear(x), got) and weight.takes(x)
        else:
            assert not weight.takes(x)
        error = (got.double() - x.double() @ exact.T).abs()
        assert bool((error <= 2**-20 * (x.double().abs() @ exact.abs().T)).all()), rows


@needs_kernel
def test_q8_weights_without_blocks_of_16_keep_the_row_kernel_and_the_kernel_refuses_bad_input() -> None:
    uneven = Q8Weight(*q8_groups(40, 64))
    assert uneven.blocked_f32() is None and uneven.float32_max_rows == Q8_FLOAT32_MAX_ROWS
    assert uneven.pair(1, torch.float32)[0] is uneven.q
    blocked = block_q8_layout(*q8_groups(32, 64))
    with pytest.raises(RuntimeError, match="takes a float32 CPU tensor"):
        torch.ops.tokenmill.q8_linear(torch.randn(1, 64).bfloat16(), *blocked)
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        torch.ops.tokenmill.q8_linear(torch.randn(1, 32), *blocked)
    with pytest.raises(RuntimeError, match="takes at least one row, got 0"):
        torch.ops.tokenmill.q8_linear(torch.randn(0, 64), *blocked)


@pytest.mark.skipif(
    not {"avx2", "fma", "f16c"} <= cpu_flags() or "avx512f" not in cpu_flags(),
    reason="the AVX2 build is checked from a CPU with AVX-512 (on an AVX2-only CPU the tests above run it)",
)
def test_the_avx2_build_under_cpu_isa_avx2(tests_under_isa: Callable[..., str]) -> None:
    """``TOKENMILL_CPU_ISA=avx2``: the kernels built without AVX-512 (8 outputs a vector, two per
    block) pass the tests above in that process."""
    output = tests_under_isa("avx2", __file__, "-k", "not avx2_build")
    assert "13 passed" in output
