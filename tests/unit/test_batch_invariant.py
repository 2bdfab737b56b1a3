"""The deterministic mode's products (layers/batch_invariant.py): a row's result is the same bits
whatever other rows share its call, at the shapes of a real model, on the machine the test runs on."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_q8 import q8_0_like
from tokenmill.layers.batch_invariant import ROW_TILE, row_kernel_available, row_tiled
from tokenmill.layers.embedding import LMHead
from tokenmill.layers.fused_moe import FusedExperts
from tokenmill.layers.int4 import quantize_int4_weight
from tokenmill.layers.linear import LinearBase
from tokenmill.layers.q8 import exact_q8_weight

BATCH_SIZES = [1, 2, 5, 16, 17, 40, 64, 130]


def test_row_tiled_pads_to_whole_tiles_and_returns_only_the_real_rows() -> None:
    seen: list[int] = []

    def matmul(rows: torch.Tensor) -> torch.Tensor:
        seen.append(rows.shape[0])
        return rows @ torch.ones(rows.shape[1], 3)

    x = torch.randn(2, 9, 4)  # [2, 9, in]: 18 rows
    out = row_tiled(matmul, x, ROW_TILE)
    assert out.shape == (2, 9, 3) and torch.equal(out, x @ torch.ones(4, 3))
    assert row_tiled(matmul, torch.randn(0, 4), ROW_TILE).shape == (0, 3)
    assert seen == [32, ROW_TILE]


def rows_alone_and_together(layer: torch.nn.Module, features: int, dtype: torch.dtype) -> None:
    """Each row of a ``BATCH_SIZES`` batch equals that row computed alone, bitwise."""
    torch.manual_seed(1)
    x = torch.randn(max(BATCH_SIZES), features).to(dtype)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(max(BATCH_SIZES))])
    for size in BATCH_SIZES:
        together = layer(x[:size])
        differing = [i for i in range(size) if not torch.equal(together[i], alone[i])]
        assert not differing, f"rows {differing[:5]} differ in a batch of {size}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 1536), (1536, 576), (576, 576)])
def test_a_tiled_linear_gives_each_row_the_same_bits_in_any_batch(
    dtype: torch.dtype, in_features: int, out_features: int
) -> None:
    """SmolLM2's projection shapes; in float32 oneDNN takes another kernel for one row than for
    many (other rounding), which the tiles hide."""
    layer = LinearBase(in_features, out_features, bias=False, dtype=dtype)
    torch.nn.init.normal_(layer.weight, std=0.05)
    layer.prepare_for_inference()
    layer.row_tile = ROW_TILE
    rows_alone_and_together(layer, in_features, dtype)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_layers_compute_through_their_float_copies_in_tiles(kind: str) -> None:
    """The int8 kernel serves small batches only (a batch-size switch); tiled, every batch goes
    through the dequantized weight, so a row's bits do not depend on the batch."""
    layer = LinearBase(576, 1536, bias=False, dtype=torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=0.05)
    assert layer.quantize_weights(kind) is None
    layer.prepare_for_inference()
    layer.row_tile = ROW_TILE
    rows_alone_and_together(layer, 576, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tiled_lm_head_gives_each_row_the_same_bits_in_any_batch(dtype: torch.dtype) -> None:
    head = LMHead(8192, 576, dtype)
    torch.nn.init.normal_(head.weight, std=0.05)
    if dtype == torch.bfloat16:
        assert head.quantize_weights("int8") is None  # the int8 kernel serves small batches only
    head.prepare_for_inference()
    head.row_tile = ROW_TILE
    rows_alone_and_together(head, 576, dtype)


def test_tiled_experts_give_each_token_the_same_bits_in_any_batch() -> None:
    """Each expert sees a different number of rows per batch; tiles make that count irrelevant."""
    experts = FusedExperts(
        num_experts=4, hidden_size=256, intermediate_size=512, hidden_act="silu", dtype=torch.float32
    )
    torch.nn.init.normal_(experts.w13, std=0.05)
    torch.nn.init.normal_(experts.w2, std=0.05)
    experts.row_tile = ROW_TILE
    torch.manual_seed(2)
    num_tokens = max(BATCH_SIZES)
    expert_ids = torch.stack([torch.randperm(4)[:2] for _ in range(num_tokens)])  # [T, 2]
    weights = torch.rand(num_tokens, 2)  # [T, 2]

    x = torch.randn(num_tokens, 256)
    alone = [experts(x[i : i + 1], weights[i : i + 1], expert_ids[i : i + 1])[0] for i in range(num_tokens)]
    for size in BATCH_SIZES:
        together = experts(x[:size], weights[:size], expert_ids[:size])
        assert all(torch.equal(together[i], alone[i]) for i in range(size)), f"a batch of {size} differs"


needs_row_kernel = pytest.mark.skipif(
    not row_kernel_available(),
    reason="the row kernels need the AVX512-BF16 build (the tiles serve elsewhere)",
)


@needs_row_kernel
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 1536), (1536, 576), (64, 40), (96, 37)])
def test_the_bfloat16_row_kernel_gives_each_row_the_same_bits_in_any_batch(
    in_features: int, out_features: int
) -> None:
    """csrc/batch_invariant_gemm_cpu.cpp: one row alone (the plain row kernel) and among 129 others
    (the register-blocked one: 6-row tiles and a partial one, 4-output blocks and single outputs past
    the last whole block), the float32 product rounded once per output within bfloat16's precision."""
    torch.manual_seed(3)
    weight = (torch.randn(out_features, in_features) * 0.05).to(torch.bfloat16)  # [out, in]
    x = torch.randn(max(BATCH_SIZES), in_features).to(torch.bfloat16)  # [130, in]
    out = torch.ops.tokenmill.batch_invariant_linear(x, weight)  # [130, out]
    reference = x.float() @ weight.float().T  # [130, out]
    torch.testing.assert_close(out.float(), reference, rtol=1e-2, atol=1e-2)
    alone = torch.cat([torch.ops.tokenmill.batch_invariant_linear(x[i : i + 1], weight) for i in range(130)])
    assert torch.equal(out, alone)
    assert torch.ops.tokenmill.batch_invariant_linear(x[:0], weight).shape == (0, out_features)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.tokenmill.batch_invariant_linear(x[:, :40], weight[:, :40].contiguous())


@needs_row_kernel
@pytest.mark.parametrize("kind", [None, "int8", "int4"])
def test_bfloat16_layers_take_the_row_kernels_without_padding(kind: str | None) -> None:
    """A tiled bfloat16 layer multiplies its rows with a row kernel (int4: the packed weight's row
    kernel, method 1), bias added after: one row is not padded to sixteen."""
    layer = LinearBase(576, 1536, bias=True, dtype=torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=0.05)
    torch.nn.init.normal_(layer.bias, std=0.05)
    if kind is not None:
        assert layer.quantize_weights(kind) is None
    layer.prepare_for_inference()
    layer.row_tile = ROW_TILE
    x = torch.randn(3, 576).to(torch.bfloat16)
    if layer.int4_weight is not None:
        w = layer.int4_weight
        bare = torch.ops.tokenmill.int4_linear(x, w.packed, w.scales, w.mins, 1)  # [3, 1536]
    else:
        bare = torch.ops.tokenmill.batch_invariant_linear(x, layer.weight)  # [3, 1536]
    assert torch.equal(layer(x), bare + layer.bias)
    rows_alone_and_together(layer, 576, torch.bfloat16)


@needs_row_kernel
def test_an_exact_8_bit_head_takes_its_row_kernel_for_any_batch() -> None:
    """The bundled SmolLM2's head holds exact 8-bit groups: the mode projects every batch with them."""
    head = LMHead(4096, 576, torch.bfloat16)
    head.weight.data.copy_(q8_0_like(4096, 576))
    assert head.keep_exact_q8()
    head.prepare_for_inference()
    head.row_tile = ROW_TILE
    x = torch.randn(2, 576).to(torch.bfloat16)
    assert head.q8_weight is not None
    assert torch.equal(head(x), head.q8_weight.linear(x))
    rows_alone_and_together(head, 576, torch.bfloat16)


@needs_row_kernel
def test_the_packed_row_kernels_give_the_bits_of_the_bfloat16_row_kernel_over_their_values() -> None:
    """int4 and exact 8-bit groups decode to the layer's bfloat16 values and run the same loop, so the
    deterministic mode may stream them for a few rows and multiply the bfloat16 weight for more."""
    torch.manual_seed(4)
    weight = (torch.randn(1536, 576) * 0.05).to(torch.bfloat16)  # [out, in]
    x = torch.randn(40, 576).to(torch.bfloat16)  # [40, in]
    int4, values, _ = quantize_int4_weight(weight)
    assert int4 is not None and values is not None
    packed = torch.ops.tokenmill.int4_linear(x, int4.packed, int4.scales, int4.mins, 1)  # [40, out]
    assert torch.equal(packed, torch.ops.tokenmill.batch_invariant_linear(x, values))
    q8_values = q8_0_like(1536, 576)
    q8 = exact_q8_weight(q8_values)
    assert q8 is not None
    assert torch.equal(q8.linear(x), torch.ops.tokenmill.batch_invariant_linear(x, q8_values))
