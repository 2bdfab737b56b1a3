"""The blocked int4 kernel for float32 rows (``csrc/int4_blocked_f32_cpu.cpp``): over the same blocked
copy as the bfloat16 kernel, it computes with the exact values ``d * q + m`` in float32, a row's bits
do not depend on the step's rows, and ``Int4Weight`` sends float32 steps of 1 to ``float32_max_rows``
rows to it. The AVX-512 build (16 outputs a vector) runs here; the AVX2 build (8 outputs a vector, an
AVX2-only CPU's) runs the same tests in a process under ``TOKENMILL_CPU_ISA=avx2``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tokenmill.layers.cpu_isa import cpu_flags
from tokenmill.layers.int4 import (
    INT4_BLOCKED_F32_MAX_ROWS,
    INT4_FLOAT32_MAX_ROWS,
    Int4Weight,
    block_int4_layout,
    dequantize_int4_float32,
    int4_blocked_f32_lanes,
    quantize_int4,
)

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


@pytest.mark.skipif(
    not {"avx2", "fma", "f16c"} <= cpu_flags() or "avx512f" not in cpu_flags(),
    reason="the AVX2 build is checked from a CPU with AVX-512 (on an AVX2-only CPU the tests above run it)",
)
def test_the_avx2_build_under_cpu_isa_avx2() -> None:
    """``TOKENMILL_CPU_ISA=avx2``: the kernels built without AVX-512 (8 outputs a vector, two per
    block) pass the tests above in that process."""
    env = {**os.environ, "TOKENMILL_CPU_ISA": "avx2"}
    code = "from tokenmill.layers.int4 import int4_blocked_f32_lanes; assert int4_blocked_f32_lanes() == 8"
    check = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert check.returncode == 0, check.stderr[-3000:]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "not avx2_build"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "8 passed" in done.stdout
