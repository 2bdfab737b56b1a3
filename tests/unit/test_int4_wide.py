"""The wide int4 kernel (``csrc/int4_wide_cpu.cpp``): bfloat16 steps of more than
``INT4_BLOCKED_MAX_ROWS`` rows over the blocked copy of an int4 weight (``Int4Weight``) or of GGUF level
groups (``LevelWeight``). It multiplies with the weights' bfloat16 values ``round_bf16(d * q + m)``, the
weight ``int4_dequantize`` gives, with float32 sums, and each row's bits depend neither on the step's
other rows nor on their number."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_int4_blocked import level_weight
from tokenmill.layers.int4 import (
    INT4_BLOCKED_MAX_ROWS,
    INT4_WIDE_MAX_ROWS,
    Int4Weight,
    int4_blocked_available,
    int4_dequantize,
    quantize_int4,
)

BF16 = torch.bfloat16
needs_kernel = pytest.mark.skipif(
    not int4_blocked_available(), reason="the blocked and wide kernels need AVX512-BF16 and no AMX tiles"
)
WIDE = INT4_BLOCKED_MAX_ROWS + 1  # the fewest rows the wide kernel takes


def one_hot_rows(features: list[int], in_features: int) -> torch.Tensor:
    """Row r is 1 at ``features[r]``, 0 elsewhere: its output is that feature's column of the weight."""
    x = torch.zeros(len(features), in_features, dtype=BF16)
    x[torch.arange(len(features)), torch.tensor(features)] = 1
    return x


@needs_kernel
@pytest.mark.parametrize("shape", [(960, 576), (16, 32), (48, 96), (576, 1536), (80, 544)])
def test_the_wide_kernel_multiplies_with_the_bfloat16_weight(shape: tuple[int, int]) -> None:
    """One-hot rows read every weight back bit for bit (one block in a panel too: 16 or 80 outputs);
    random rows are the float32 sums of the products with that weight."""
    out_features, in_features = shape
    packed, scales, mins = quantize_int4(torch.randn(shape) / in_features**0.5 + 0.01)
    weight = Int4Weight(packed, scales, mins)
    blocked = weight.blocked()
    assert blocked is not None and weight.max_rows == INT4_WIDE_MAX_ROWS
    bf16_weight = int4_dequantize(packed, scales, mins)  # [out, in] round_bf16(d * q + m)
    features = list(range(in_features))
    for first in range(0, in_features, 64):  # steps of 64 one-hot rows (the last may be smaller)
        chunk = features[first : first + 64]
        x = one_hot_rows(chunk + [0] * max(0, WIDE - len(chunk)), in_features)
        got = torch.ops.tokenmill.int4_linear(x, *blocked)  # [rows, out]
        assert torch.equal(got[: len(chunk)], bf16_weight[:, chunk].T)
    x = torch.randn(70, in_features, dtype=BF16)
    got = weight.linear(x, None)
    assert got.dtype == BF16 and got.shape == (70, out_features)
    exact = x.double() @ bf16_weight.double().T
    magnitude = x.double().abs() @ bf16_weight.double().abs().T
    assert bool(((got.double() - exact).abs() <= 2**-8 * exact.abs() + 2**-20 * magnitude).all())


@needs_kernel
def test_a_rows_bits_do_not_depend_on_the_step() -> None:
    """Every row count from the wide kernel's first through several tiles of 12 rows, and steps that
    start elsewhere in the rows, give each row the same bits."""
    packed, scales, mins = quantize_int4(torch.randn(96, 160) / 12)
    blocked = Int4Weight(packed, scales, mins).blocked()
    assert blocked is not None
    x_all = torch.randn(80, 160, dtype=BF16)
    full = torch.ops.tokenmill.int4_linear(x_all, *blocked)  # [80, 96]
    for first, rows in [(0, WIDE), (0, 24), (0, 25), (0, 37), (3, WIDE), (11, 40), (50, 30)]:
        got = torch.ops.tokenmill.int4_linear(x_all[first : first + rows], *blocked)
        assert torch.equal(got, full[first : first + rows]), (first, rows)


@needs_kernel
@pytest.mark.parametrize("five", [False, True])
def test_gguf_level_groups_take_the_wide_kernel_with_their_bfloat16_values(five: bool) -> None:
    """Float32 scales (Q4_K) and 5-bit levels (Q5_0's fifth bits): above the blocked kernel's rows the
    layer multiplies with its values rounded to bfloat16."""
    weight = level_weight(48, 96, five, seed=3)
    assert weight.max_rows == INT4_WIDE_MAX_ROWS
    bf16_weight = weight.dequantize().to(BF16)  # [out, in]
    x = one_hot_rows(list(range(96)), 96)
    assert torch.equal(weight.linear(x), bf16_weight.T)
    x = torch.randn(WIDE + 5, 96, dtype=BF16)
    got = weight.linear(x)
    exact = x.double() @ bf16_weight.double().T
    magnitude = x.double().abs() @ bf16_weight.double().abs().T
    assert bool(((got.double() - exact).abs() <= 2**-8 * exact.abs() + 2**-20 * magnitude).all())


@needs_kernel
def test_the_wide_kernel_refuses_rows_it_cannot_read_in_pairs() -> None:
    blocked = Int4Weight(*quantize_int4(torch.randn(32, 64))).blocked()
    assert blocked is not None
    odd_stride = torch.randn(WIDE, 65, dtype=BF16)[:, :64]  # rows 65 elements apart
    with pytest.raises(RuntimeError, match="contiguous features and an even row stride"):
        torch.ops.tokenmill.int4_linear(odd_stride, *blocked)
    assert torch.ops.tokenmill.int4_linear(odd_stride[:INT4_BLOCKED_MAX_ROWS], *blocked).shape == (16, 32)


def blocked_silu_and_mul(x: torch.Tensor, blocked: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
    return torch.ops.tokenmill.int4_linear_blocked_silu_and_mul(x, *blocked)


@needs_kernel
@pytest.mark.parametrize("shape", [(3072, 576), (64, 96)])
def test_the_gate_up_activation_in_the_epilogue_is_silu_and_mul_bit_for_bit(shape: tuple[int, int]) -> None:
    """``int4_linear_blocked_silu_and_mul`` (the decoder stack's gate_up and activation in one call: the
    blocked kernel's tasks and the wide kernel's epilogue pair gate block p with up block p + blocks / 2)
    gives the bits of ``silu_and_mul`` over the product, on the blocked kernel's steps and the wide
    kernel's; large gates included."""
    out_features, in_features = shape
    packed, scales, mins = quantize_int4(torch.randn(shape) / in_features**0.5 * 8 + 0.01)
    blocked = Int4Weight(packed, scales, mins).blocked()
    assert blocked is not None
    for rows in (1, 5, INT4_BLOCKED_MAX_ROWS, WIDE, 30, 64):
        x = torch.randn(rows, in_features, dtype=BF16)
        product = torch.ops.tokenmill.int4_linear(x, *blocked)  # [rows, 2 * intermediate]
        got = blocked_silu_and_mul(x, blocked)
        assert got.shape == (rows, out_features // 2)
        assert torch.equal(got, torch.ops.tokenmill.silu_and_mul(product)), rows
    reference = (
        torch.nn.functional.silu(product[:, : out_features // 2].float()).to(BF16)
        * product[:, out_features // 2 :]
    )
    assert torch.equal(got, reference)  # transformers' LlamaMLP in bfloat16


@needs_kernel
@pytest.mark.parametrize("five", [False, True])
def test_gguf_level_groups_get_the_fused_activation(five: bool) -> None:
    weight = level_weight(64, 96, five, seed=5)
    blocked = weight.kernel_tensors()
    assert blocked[0].dim() == 3  # the blocked layout
    for rows in (1, 7, WIDE + 3):  # the blocked kernel's steps and the wide kernel's
        x = torch.randn(rows, 96, dtype=BF16)
        assert torch.equal(
            blocked_silu_and_mul(x, blocked), torch.ops.tokenmill.silu_and_mul(weight.linear(x))
        )


@needs_kernel
def test_the_activation_needs_whole_blocks_of_gates_and_ups() -> None:
    blocked = Int4Weight(*quantize_int4(torch.randn(48, 64))).blocked()  # 3 blocks of 16 outputs
    assert blocked is not None
    with pytest.raises(RuntimeError, match="gate and up halves of whole blocks of 16 outputs, got 3 blocks"):
        blocked_silu_and_mul(torch.randn(WIDE, 64, dtype=BF16), blocked)
