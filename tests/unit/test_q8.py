"""Exact 8-bit groups (GGUF Q8_0's format, layers/q8.py): recovering them from a bfloat16 weight, the
kernel against the product with the same weight, and the LM head that uses them for small steps."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.embedding import LMHead, VocabEmbedding
from tokenmill.layers.q8 import (
    Q8_MAX_ROWS,
    Q8Weight,
    dequantize_q8_reference,
    exact_q8_groups,
    exact_q8_weight,
)

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def q8_0_like(out_features: int, in_features: int) -> torch.Tensor:
    """A bfloat16 weight as a Q8_0 GGUF tensor loads: per group of 32, d = fp16(max|x| / 127),
    q = round(x / d), value bf16(d * q) (written here from the GGUF definition, not the module)."""
    x = torch.randn(out_features, in_features // 32, 32) * torch.rand(out_features, in_features // 32, 1)
    d = (x.abs().amax(dim=2, keepdim=True) / 127).to(torch.float16).float()  # [out, G, 1]
    q = torch.round(x / d).clamp(-127, 127)
    return (q * d).to(BF16).reshape(out_features, in_features)


@pytest.mark.parametrize("shape", [(200, 64), (37, 576), (1, 32)])
def test_a_q8_0_weight_is_recovered_exactly(shape: tuple[int, int]) -> None:
    weight = q8_0_like(*shape)
    weight[0, :32] = 0  # an all-zero group
    groups = exact_q8_groups(weight)
    assert groups is not None
    q, scales = groups
    assert q.dtype == torch.int8 and q.shape == shape
    assert scales.dtype == torch.float16 and scales.shape == (shape[0], shape[1] // 32)
    assert torch.equal(dequantize_q8_reference(q, scales), weight)


def test_other_weights_have_no_exact_groups() -> None:
    assert exact_q8_groups(torch.randn(64, 64, dtype=BF16)) is None  # plain bfloat16 values
    assert exact_q8_groups(q8_0_like(8, 64)[:, :48].contiguous()) is None  # 48 is not a multiple of 32
    near = q8_0_like(16, 64)
    near[5, 7] = near[5, 7] * 1.5 + 0.001  # one value off its group's grid
    assert exact_q8_groups(near) is None


@pytest.mark.parametrize("shape", [(49, 576), (130, 64), (16, 1536)])
def test_kernel_equals_the_product_with_the_same_weight(shape: tuple[int, int]) -> None:
    out_features, in_features = shape
    weight = q8_0_like(out_features, in_features)
    kernel = exact_q8_weight(weight)  # builds and loads the kernels
    assert isinstance(kernel, Q8Weight)
    for rows in (1, 2, 5, 17):
        x = torch.randn(rows, in_features, dtype=BF16)
        got = kernel.linear(x)
        assert got.dtype == BF16 and got.shape == (rows, out_features)
        expected = (x.float() @ weight.float().T).to(BF16).float()
        # Float32 accumulation in another order, then one bfloat16 rounding each: 1 ulp apart.
        assert torch.allclose(got.float(), expected, rtol=2**-7, atol=1e-5), rows


def test_kernel_rejects_bad_shapes() -> None:
    assert exact_q8_weight(q8_0_like(4, 64)) is not None  # builds and loads the kernels
    q = torch.zeros(4, 64, dtype=torch.int8)
    scales = torch.zeros(4, 2, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        torch.ops.tokenmill.q8_linear(torch.zeros(1, 32, dtype=BF16), q, scales)
    with pytest.raises(RuntimeError, match=r"scales must be contiguous float16 \[4, 2\]"):
        torch.ops.tokenmill.q8_linear(torch.zeros(1, 64, dtype=BF16), q, scales[:, :1])


def test_the_lm_head_projects_small_steps_from_the_groups_and_larger_steps_from_its_weight() -> None:
    embedding = VocabEmbedding(300, 64, BF16)
    embedding.weight.data.copy_(q8_0_like(300, 64))
    table = embedding.weight.data.clone()
    head = LMHead(300, 64, BF16, tied_to=embedding)
    assert head.keep_exact_q8()
    head.prepare_for_inference()
    assert torch.equal(embedding.weight.data, table)  # the lookup table is untouched
    assert head.q8_weight is not None
    one = torch.randn(1, 64, dtype=BF16)
    assert torch.equal(head(one), head.q8_weight.linear(one))
    small = torch.randn(Q8_MAX_ROWS, 64, dtype=BF16)
    assert torch.equal(head(small), head.q8_weight.linear(small))
    assert torch.equal(head(small)[:1], head(small[:1]))  # a row's bits do not depend on the step's rows
    many = torch.randn(6, 64, dtype=BF16)
    expected = (many.float() @ table.float().T).to(BF16).float()
    assert torch.allclose(head(many).float(), expected, rtol=2**-7, atol=1e-5)
    assert torch.allclose(
        head(one).float(), (one.float() @ table.float().T).to(BF16).float(), rtol=2**-7, atol=1e-5
    )

    plain = LMHead(300, 64, BF16, tied_to=VocabEmbedding(300, 64, BF16))
    plain.tied_to.weight.data.copy_(torch.randn(300, 64))  # type: ignore[union-attr]
    assert not plain.keep_exact_q8() and plain.q8_weight is None
