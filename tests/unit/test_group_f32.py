"""float32 rows times int4 and exact 8-bit groups (csrc/group_gemm_f32_cpu.cpp): the kernels against
the product with the same float32 weight values, the layers that keep such copies in a float32 model,
and a float32 model end to end (greedy tokens equal with and without the copies)."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from tokenmill.layers.int4 import (
    INT4_BLOCKED_F32_MAX_ROWS,
    INT4_FLOAT32_MAX_ROWS,
    dequantize_int4_float32,
    int4_blocked_f32_lanes,
    int4_linear,
    quantize_int4,
)
from tokenmill.layers.linear import RowParallelLinear
from tokenmill.layers.q8 import Q8_FLOAT32_MAX_ROWS, Q8_MAX_ROWS, Q8Weight, exact_q8_groups

ROW_COUNTS = (1, 2, 3, 5, 8)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def on_int4_grid(out_features: int, in_features: int) -> torch.Tensor:
    """A float32 weight as a Q4_1 GGUF tensor dequantizes: ``d * q + m`` per group of 32."""
    packed, scales, mins = quantize_int4(torch.randn(out_features, in_features) / in_features**0.5)
    return dequantize_int4_float32(packed, scales, mins)


def q8_0_float32(out_features: int, in_features: int) -> torch.Tensor:
    """A float32 weight as a Q8_0 GGUF tensor dequantizes (GGUF's definition): d = fp16(max|x| / 127),
    q = round(x / d), value d * q."""
    x = torch.randn(out_features, in_features // 32, 32) * torch.rand(out_features, in_features // 32, 1)
    d = (x.abs().amax(dim=2, keepdim=True) / 127).to(torch.float16).float()  # [out, G, 1]
    return (torch.round(x / d).clamp(-127, 127) * d).reshape(out_features, in_features)


@pytest.mark.parametrize("shape", [(960, 576), (37, 64), (1, 32), (576, 1536)])
def test_int4_kernel_on_float32_rows_equals_the_product_with_the_float32_values(
    shape: tuple[int, int],
) -> None:
    out_features, in_features = shape
    weight = on_int4_grid(*shape)
    packed, scales, mins = quantize_int4(weight)
    assert torch.equal(dequantize_int4_float32(packed, scales, mins), weight)  # the grid round-trips
    x_all = torch.randn(max(ROW_COUNTS), in_features)
    for rows in ROW_COUNTS:
        got = int4_linear(x_all[:rows], packed, scales, mins, None)
        assert got.dtype == torch.float32 and got.shape == (rows, out_features)
        # The same float32 products summed in another order.
        assert torch.allclose(got, x_all[:rows] @ weight.T, rtol=1e-5, atol=1e-5), rows
    wide = torch.randn(3, in_features * 2)  # a strided view of rows, and a bias
    bias = torch.randn(out_features)
    got = int4_linear(wide[:, :in_features], packed, scales, mins, bias)
    assert torch.allclose(got, wide[:, :in_features] @ weight.T + bias, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="tile and level-sums kernels take bfloat16 rows"):
        int4_linear(x_all[:1], packed, scales, mins, None, 2)


@pytest.mark.parametrize("shape", [(49, 576), (130, 64), (16, 1536)])
def test_q8_groups_of_a_float32_weight_and_the_kernel(shape: tuple[int, int]) -> None:
    weight = q8_0_float32(*shape)
    weight[0, :32] = 0  # an all-zero group
    groups = exact_q8_groups(weight)
    assert groups is not None
    q, scales = groups
    assert q.dtype == torch.int8 and scales.dtype == torch.float16
    expected_weight = (q.float().reshape(shape[0], -1, 32) * scales.float()[..., None]).reshape(shape)
    assert torch.equal(expected_weight, weight)
    head = Q8Weight(q, scales)
    x_all = torch.randn(max(ROW_COUNTS) + 1, shape[1])
    for rows in ROW_COUNTS:
        assert head.takes(x_all[:rows]) == (rows <= head.float32_max_rows)
        got = head.linear(x_all[:rows])
        assert got.dtype == torch.float32
        # The same float32 products summed in another order (sums of ~1,500 terms of size ~1).
        assert torch.allclose(got, x_all[:rows] @ weight.T, rtol=1e-4, atol=1e-4 * shape[1] ** 0.5), rows
    # Outputs a multiple of 16: the blocked kernel's bound, else the row kernel's.
    blocks = shape[0] % 16 == 0 and int4_blocked_f32_lanes() > 0
    assert head.float32_max_rows == (
        INT4_BLOCKED_F32_MAX_ROWS[int4_blocked_f32_lanes()] if blocks else Q8_FLOAT32_MAX_ROWS
    )
    assert not head.takes(torch.randn(head.float32_max_rows + 1, shape[1]))  # above: the float32 weight
    bf16_rows = x_all.bfloat16()  # bfloat16: up to Q8_MAX_ROWS
    assert head.takes(bf16_rows[:Q8_MAX_ROWS]) and not head.takes(bf16_rows[: Q8_MAX_ROWS + 1])
    # A float32 weight off the grid has no exact groups.
    assert exact_q8_groups(weight + 1e-3) is None


def test_a_float32_layer_on_the_int4_grid_keeps_an_int4_copy_and_others_do_not() -> None:
    layer = RowParallelLinear(576, 96, bias=False, dtype=torch.float32)
    layer.weight.data.copy_(on_int4_grid(96, 576))
    before = layer.weight.data.clone()
    assert layer.quantize_weights("int4", lossless_only=True) is None
    assert torch.equal(layer.weight.data, before) and layer.int4_weight is not None
    # Up to the blocked kernel's rows (96 outputs: a multiple of 16), else the row kernel's.
    top = (
        INT4_BLOCKED_F32_MAX_ROWS[int4_blocked_f32_lanes()]
        if int4_blocked_f32_lanes()
        else INT4_FLOAT32_MAX_ROWS
    )
    x = torch.randn(top, 576)
    assert layer.int4_weight.takes(x) and not layer.int4_weight.takes(torch.randn(top + 1, 576))
    assert torch.allclose(layer(x), x @ before.T, rtol=1e-5, atol=1e-5)
    off_grid = RowParallelLinear(576, 96, bias=False, dtype=torch.float32)
    off_grid.weight.data.copy_(torch.randn(96, 576))
    assert off_grid.quantize_weights("int4", lossless_only=True) == "its values are not exactly 4-bit groups"
    assert off_grid.int4_weight is None


def test_a_float32_model_on_the_int4_grid_gives_the_same_greedy_tokens_with_the_copies(
    tiny_model,  # type: ignore[no-untyped-def]
    tmp_path,  # type: ignore[no-untyped-def]
    caplog: pytest.LogCaptureFixture,
) -> None:
    """float32 llama whose projections are exactly 4-bit groups: small steps run the int4 kernel on
    float32 rows (in the fused stack where it applies), large ones the float32 weight; the greedy
    tokens equal those with ``quantization="none"`` (no copies), alone and in a batch of 12."""
    from safetensors.torch import load_file, save_file

    from tokenmill import LLM, SamplingParams

    source = tiny_model("llama").path
    weights = load_file(f"{source}/model.safetensors")
    on_grid = {}
    for name, tensor in weights.items():
        if name.endswith("proj.weight") and tensor.shape[1] % 32 == 0:
            packed, scales, mins = quantize_int4(tensor.float())
            tensor = dequantize_int4_float32(packed, scales, mins)
        on_grid[name] = tensor
    folder = tmp_path / "on-grid"
    shutil.copytree(source, folder)
    save_file(on_grid, str(folder / "model.safetensors"))

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [7 + i, 8, 9, 10 + i, 11]} for i in range(12)]

    def tokens(**kwargs: str) -> list[list[int]]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tokenmill.worker.model_runner"):
            llm = LLM(str(folder), dtype="float32", num_blocks=64, enable_prefix_caching=False, **kwargs)
        alone = llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].token_ids
        batch = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        return [alone, *batch]

    exact = tokens()
    assert "exactly 4-bit layers (lossless)" in caplog.text
    assert tokens(quantization="none") == exact
    assert "exactly 4-bit" not in caplog.text
