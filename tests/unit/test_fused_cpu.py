"""The fused bfloat16 CPU ops reproduce the unfused torch layers bit for bit on these inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers import fused_cpu
from tokenmill.layers.norm import RMSNorm, _rms_normalize
from tokenmill.layers.rotary import RotaryEmbedding

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="module")
def _kernels() -> None:
    """Builds and loads the kernels, so that every test here also runs alone (``-k``)."""
    assert fused_cpu.applies_to(torch.zeros(1, dtype=BF16))


def test_applies_to_bfloat16_and_float32_cpu_tensors_only() -> None:
    assert fused_cpu.applies_to(torch.zeros(2, dtype=BF16))
    assert fused_cpu.applies_to(torch.zeros(2, dtype=torch.float32))
    assert not fused_cpu.applies_to(torch.zeros(2, dtype=torch.float16))
    assert not fused_cpu.applies_to(torch.zeros(2, dtype=torch.float32, device="meta"))


def _llama_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * _rms_normalize(x, eps).to(x.dtype)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """bfloat16: the same bits as the unfused ops (the same rounding steps). float32: within a few ulps
    (the RMS sums and the vector exp run in another order than torch's)."""
    if got.dtype == BF16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 70])
def test_rms_norm_matches_unfused(rows: int, dtype: torch.dtype) -> None:
    x = torch.randn(rows, 576, dtype=dtype) * 3
    weight = torch.randn(576, dtype=dtype)
    assert_same(fused_cpu.rms_norm(x, weight, 1e-5), _llama_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_add_rms_norm_is_in_place_and_matches_unfused(dtype: torch.dtype) -> None:
    x = torch.randn(9, 576, dtype=dtype)
    residual = torch.randn(9, 576, dtype=dtype)
    weight = torch.randn(576, dtype=dtype)
    summed = residual + x
    expected = _llama_norm(summed, weight, 1e-6)
    x_in, residual_in = x.clone(), residual.clone()
    normed, new_residual = fused_cpu.add_rms_norm(x_in, residual_in, weight, 1e-6)
    assert normed.data_ptr() == x_in.data_ptr() and new_residual.data_ptr() == residual_in.data_ptr()
    assert torch.equal(new_residual, summed)
    assert_same(normed, expected)


def test_rmsnorm_module_uses_the_same_numbers_on_both_paths() -> None:
    norm = RMSNorm(64, 1e-6).to(BF16)
    norm.weight.data.copy_(torch.randn(64))
    x = torch.randn(5, 64, dtype=BF16)
    residual = torch.randn(5, 64, dtype=BF16)
    expected_sum = residual + x
    normed, new_residual = norm(x.clone(), residual.clone())
    assert torch.equal(new_residual, expected_sum)
    assert torch.equal(normed, norm._norm(expected_sum))


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("size", [1536, 70])  # 70: a partial last vector
@pytest.mark.parametrize("rows", [13, 66])  # 66 rows of 1,536 are split over the threads
def test_silu_and_mul_matches_unfused(rows: int, size: int, dtype: torch.dtype) -> None:
    gate_up = torch.randn(rows, 2 * size, dtype=dtype) * 4
    expected = F.silu(gate_up[:, :size]) * gate_up[:, size:]
    assert_same(fused_cpu.silu_and_mul(gate_up), expected)


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_silu_and_mul_at_the_edges_of_exp(dtype: torch.dtype) -> None:
    """The kernels' vector exp (whichever of AVX-512, AVX2 or plain loops this CPU builds) where it
    underflows, overflows and meets infinities and NaN: silu(g) * 1 as torch computes it."""
    edges = [1e4, 300, 171, 150, 100, 88.8, 87, 50, 1, 1e-3, 0.0, float("inf")]
    gate = torch.tensor([*edges, *[-e for e in edges], float("nan")], dtype=dtype)  # 25: a partial vector
    got = fused_cpu.silu_and_mul(torch.cat([gate, torch.ones_like(gate)]).unsqueeze(0))[0]
    expected = F.silu(gate.float()).to(dtype)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0, equal_nan=True)


def test_rms_norm_of_a_width_with_a_partial_last_vector_matches_unfused() -> None:
    x = torch.randn(3, 100, dtype=BF16) * 3
    weight = torch.randn(100, dtype=BF16)
    assert torch.equal(fused_cpu.rms_norm(x, weight, 1e-5), _llama_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_in_place_matches_unfused_on_fused_qkv_views(rotary_dim: int, dtype: torch.dtype) -> None:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    rotary = RotaryEmbedding(64, rotary_dim, inv_freq, 4096)
    qkv = torch.randn(37, (9 + 3 + 3) * 64, dtype=dtype)  # [tokens, q | k | v]
    positions = torch.randint(0, 4096, (37,))
    query = qkv[:, : 9 * 64].view(37, 9, 64)
    key = qkv[:, 9 * 64 : 12 * 64].view(37, 3, 64)
    cos, sin = rotary._cos_sin(positions, None)
    expected_q, expected_k = rotary._rotate(query, cos, sin), rotary._rotate(key, cos, sin)
    value_before = qkv[:, 12 * 64 :].clone()
    got_q, got_k = rotary(positions, query, key)
    assert got_q.data_ptr() == query.data_ptr()  # rotated in place
    assert_same(got_q, expected_q)
    assert_same(got_k, expected_k)
    assert torch.equal(qkv[:, 12 * 64 :], value_before)


def test_rotary_rejects_positions_outside_the_cache() -> None:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    rotary = RotaryEmbedding(8, 8, inv_freq, 16)
    query = torch.randn(2, 1, 8, dtype=BF16)
    key = torch.randn(2, 1, 8, dtype=BF16)
    with pytest.raises(RuntimeError, match="outside the rotary cache"):
        rotary(torch.tensor([3, 16]), query, key)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("size", [49152, 49155, 7, 16, 33])
def test_argmax_rows_is_torch_argmax_with_ties_nans_and_infinities(dtype: torch.dtype, size: int) -> None:
    assert fused_cpu.argmax_applies_to(torch.zeros(2, size, dtype=dtype))
    x = torch.randn(12, size, generator=torch.Generator().manual_seed(size)).to(dtype)
    x[1, :] = x[1, 0]  # all tied: the first index
    x[2, size - 1] = x[2].max() + 1  # the maximum in the scalar tail (size % 16 != 0)
    x[3, size // 2] = float("nan")  # NaN beats everything, the first NaN wins
    x[3, size - 1] = float("nan")
    x[4, 1] = float("inf")
    x[5, :] = float("-inf")
    x[6, :] = -5.0  # every value negative and tied
    x[7, 0], x[7, size - 1] = 3e4, 3e4  # tie between the first and the last column
    assert torch.equal(fused_cpu.argmax_rows(x), x.argmax(dim=-1))
    sliced = x[:, : size - 1] if size > 1 else x  # rows with a stride larger than their length
    assert torch.equal(fused_cpu.argmax_rows(sliced), sliced.argmax(dim=-1))
