"""Weight-only int8: the rounding, the kernel against the dequantized weights, and the engine option."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.linear import MergedColumnLinear
from tokenmill.layers.quantization import (
    INT8_MAX_ROWS,
    check_quantization,
    dequantize_int8_rows,
    int8_linear,
    quantize_int8_rows,
)

BF16 = torch.bfloat16


def test_rounding_error_is_at_most_half_a_step_per_row() -> None:
    weight = torch.randn(64, 96) * torch.linspace(0.01, 3.0, 64)[:, None]
    weight[5] = 0.0  # an all-zero row must not divide by zero
    qweight, scales = quantize_int8_rows(weight.to(BF16))
    assert qweight.dtype == torch.int8 and scales.dtype == BF16
    assert int(qweight.abs().max()) <= 127
    error = (dequantize_int8_rows(qweight, scales).float() - weight.to(BF16).float()).abs()
    bound = scales.float()[:, None] / 2 + weight.abs() * 2**-7  # half a step, plus bf16 rounding
    assert bool((error <= bound).all())
    assert torch.equal(qweight[5], torch.zeros(96, dtype=torch.int8))


def test_int8_kernel_matches_the_dequantized_weights() -> None:
    torch.manual_seed(0)
    weight = torch.randn(192, 128, dtype=BF16)
    qweight, scales = quantize_int8_rows(weight)
    x = torch.randn(3, 128, dtype=BF16)
    bias = torch.randn(192, dtype=BF16)
    expected = x.float() @ dequantize_int8_rows(qweight, scales).float().T + bias.float()
    got = int8_linear(x, qweight, scales, bias).float()
    assert torch.allclose(got, expected, rtol=2e-2, atol=5e-2)


def test_small_and_large_batches_compute_with_the_same_weights() -> None:
    torch.manual_seed(1)
    layer = MergedColumnLinear(128, {"a": 64, "b": 32}, bias=False, dtype=BF16)
    layer.weight.data.copy_(torch.randn(96, 128))
    original = layer.weight.data.clone()
    layer.quantize_weights("int8")
    layer.prepare_for_inference()
    assert layer.int8_weight is not None and layer.int8_scales is not None
    assert torch.equal(layer.weight.data, dequantize_int8_rows(layer.int8_weight, layer.int8_scales))
    assert not torch.equal(layer.weight.data, original)
    x = torch.randn(INT8_MAX_ROWS + 8, 128, dtype=BF16)
    large = layer(x).float()  # bfloat16 GEMM on the dequantized weights
    small = layer(x[:4]).float()  # the int8 kernel
    assert torch.allclose(small, large[:4], rtol=2e-2, atol=5e-2)


def test_check_quantization_errors() -> None:
    check_quantization(None, torch.float32, torch.device("cpu"))
    check_quantization("int8", BF16, torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        check_quantization("int3", BF16, torch.device("cpu"))
    with pytest.raises(ValueError, match="needs dtype bfloat16 on CPU"):
        check_quantization("int8", torch.float32, torch.device("cpu"))


def test_engine_runs_int8_and_rejects_it_in_float32(tiny_model, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    from tokenmill import LLM, SamplingParams

    path = tiny_model("llama").path
    with pytest.raises(ValueError, match="needs dtype bfloat16 on CPU"):
        LLM(path, dtype="float32", quantization="int8", num_blocks=16)
    with caplog.at_level("INFO", logger="tokenmill.worker.model_runner"):
        llm = LLM(path, dtype="bfloat16", quantization="int8", num_blocks=32)
    assert "int8 weights in" in caplog.text
    outputs = llm.generate(
        [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10]}],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in outputs] == [6, 6]
