"""The model dtype on CPUs with and without bfloat16 instructions (``resolve_dtype``), and oneDNN's
packed weights: float32 always, bfloat16 only where its bfloat16 kernels exist (``packing_available``)."""

from __future__ import annotations

import logging

import pytest
import torch

from tokenmill.layers import cpu_gemm
from tokenmill.worker import model_runner
from tokenmill.worker.model_runner import resolve_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_bfloat16_only_where_the_cpu_computes_it(
    native: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(model_runner, "cpu_computes_bfloat16", lambda: native)
    with caplog.at_level(logging.WARNING, logger=model_runner.__name__):
        assert resolve_dtype("auto", CPU) == (torch.bfloat16 if native else torch.float32)
        assert resolve_dtype("float32", CPU) == torch.float32
    assert caplog.records == []
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_explicit_bfloat16_without_the_instructions_is_kept_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(model_runner, "cpu_computes_bfloat16", lambda: False)
    with caplog.at_level(logging.WARNING, logger=model_runner.__name__):
        assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert [record.levelno for record in caplog.records] == [logging.WARNING]
    assert "no bfloat16 instructions" in caplog.records[0].getMessage()
    assert "--dtype auto picks float32" in caplog.records[0].getMessage()


def test_weights_are_packed_only_where_onednn_has_kernels_for_their_dtype(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    weight = torch.zeros(8, 16, dtype=torch.bfloat16)
    onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    monkeypatch.setattr(cpu_gemm, "cpu_computes_bfloat16", lambda: False)
    assert not cpu_gemm.packing_available(weight)
    assert cpu_gemm.packing_available(weight.float()) == onednn  # AVX2's float32 kernels: every x86 CPU
    monkeypatch.setattr(cpu_gemm, "cpu_computes_bfloat16", lambda: True)
    assert cpu_gemm.packing_available(weight) == onednn
    assert cpu_gemm.packing_available(weight.float()) == onednn
    assert not cpu_gemm.packing_available(weight.half())


@pytest.mark.parametrize("rows", [1, 5, 16, 64, 300])
def test_packed_float32_linear_matches_f_linear(rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=generator)  # [out, in]
    bias = torch.randn(96, generator=generator)
    x = torch.randn(rows, 80, generator=generator)
    packed = cpu_gemm.packed_linear(x, cpu_gemm.pack_weight(weight), bias)  # [rows, 96]
    reference = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    assert packed.dtype == torch.float32 and packed.shape == (rows, 96)
    # float32 products of 80 terms: a few ulps of the sum of magnitudes, as F.linear's own error.
    bound = 1e-6 * (x.abs().double() @ weight.abs().double().T + bias.abs().double())
    assert bool(((packed.double() - reference).abs() <= bound).all())
