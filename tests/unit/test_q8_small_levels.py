"""Exact 8-bit groups of small levels (layers/q8.py ``exact_small_level_groups``): a Q5_0 GGUF tensor
as loaded in bfloat16 / float32 is recovered exactly, other weights are not, and a linear layer with
such a weight projects single rows through the 8-bit kernel with the same values."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.int4 import int4_pairs_available
from tokenmill.layers.linear import ColumnParallelLinear
from tokenmill.layers.q8 import dequantize_q8_reference, exact_small_level_groups

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def q5_0_like(out_features: int, in_features: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    """A weight as a Q5_0 GGUF tensor loads (written from the GGUF definition, not the module): per
    group of 32, ``max`` the value of largest magnitude, d = fp16(max / -16), level
    q = min(31, floor(x / d + 16.5)), value ``dtype(d * (q - 16))``."""
    x = torch.randn(out_features, in_features // 32, 32) * torch.rand(out_features, in_features // 32, 1)
    index = x.abs().argmax(dim=2, keepdim=True)
    d = (torch.gather(x, 2, index) / -16).to(torch.float16).float()  # [out, G, 1]
    q = torch.floor(x / d + 16.5).clamp(0, 31)
    return ((q - 16) * d).to(dtype).reshape(out_features, in_features)


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("shape", [(200, 64), (37, 640), (1, 32)])
def test_a_q5_0_weight_is_recovered_exactly(shape: tuple[int, int], dtype: torch.dtype) -> None:
    weight = q5_0_like(*shape, dtype=dtype)
    weight[0, :32] = 0  # an all-zero group
    groups = exact_small_level_groups(weight)
    assert groups is not None
    q, scales = groups
    assert q.dtype == torch.int8 and q.shape == shape
    assert scales.dtype == torch.float16 and scales.shape == (shape[0], shape[1] // 32)
    decoded = (q.reshape(shape[0], -1, 32).float() * scales.float()[..., None]).to(dtype)
    assert torch.equal(decoded.reshape(shape), weight)
    if dtype == BF16:
        assert torch.equal(dequantize_q8_reference(q, scales), weight)


def test_other_weights_have_no_exact_small_level_groups() -> None:
    assert exact_small_level_groups(torch.randn(64, 64, dtype=BF16)) is None  # plain bfloat16 values
    assert exact_small_level_groups(q5_0_like(8, 64)[:, :48].contiguous()) is None  # 48 % 32 != 0
    assert exact_small_level_groups(q5_0_like(8, 64).half()) is None  # float16: not a dtype it reads
    near = q5_0_like(16, 64)
    near[5, 7] = near[5, 7] * 1.37 + 0.001  # one value off its group's grid (a row past the first)
    assert exact_small_level_groups(near) is None


def test_a_linear_layer_projects_single_rows_through_the_groups() -> None:
    layer = ColumnParallelLinear(640, 96, bias=True, dtype=BF16)
    layer.weight.data.copy_(q5_0_like(96, 640))
    layer.bias.data.copy_(torch.randn(96))
    before = layer.weight.data.clone()
    assert layer.keep_exact_q8()
    # The 8-bit copy, or where the level-sums kernel runs the 5-bit one (layers/level_sums.py).
    assert (layer.q8_weight is None) == int4_pairs_available() and (
        layer.level_weight is None
    ) != int4_pairs_available()
    assert torch.equal(layer.weight.data, before)  # weight unchanged
    x = torch.randn(1, 640, dtype=BF16)
    # The values each copy computes with: the bfloat16 weight (8-bit), the unrounded d * q (5-bit).
    values = before.float() if layer.level_weight is None else layer.level_weight.dequantize()
    expected = ((x.float() @ values.T).to(BF16) + layer.bias).float()
    got = layer(x)
    assert got.dtype == BF16 and got.shape == (1, 96)
    # The kernel accumulates in float32 in another order (the level sums with the unrounded values);
    # each output is about one bfloat16 rounding apart.
    assert torch.allclose(got.float(), expected, rtol=2**-6, atol=1e-2)
    plain = ColumnParallelLinear(64, 8, bias=False, dtype=BF16)
    plain.weight.data.copy_(torch.randn(8, 64))
    assert not plain.keep_exact_q8() and plain.q8_weight is None
