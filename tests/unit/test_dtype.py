"""The model dtype on CPUs with and without bfloat16 instructions (``resolve_dtype``), and oneDNN's
packed bfloat16 weights only where its bfloat16 kernels exist (``packing_available``)."""

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


def test_weights_are_packed_only_where_onednn_has_bfloat16_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.zeros(8, 16, dtype=torch.bfloat16)
    monkeypatch.setattr(cpu_gemm, "cpu_computes_bfloat16", lambda: False)
    assert not cpu_gemm.packing_available(weight)
    monkeypatch.setattr(cpu_gemm, "cpu_computes_bfloat16", lambda: True)
    assert cpu_gemm.packing_available(weight) == (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )
    assert not cpu_gemm.packing_available(weight.float())
