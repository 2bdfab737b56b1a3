"""The model dtype on CPUs with and without bfloat16 instructions (``resolve_dtype``), and packed
weights: float32 always (AVX2 panels where the CPU has no AVX-512, else oneDNN), bfloat16 only where
oneDNN's bfloat16 kernels exist (``packing_available``)."""

from __future__ import annotations

import logging

import pytest
import torch

from tokenmill.layers import cpu_gemm
from tokenmill.layers.batch_invariant import row_kernel_available
from tokenmill.worker import model_runner
from tokenmill.worker.model_runner import resolve_dtype

CPU = torch.device("cpu")
needs_panels = pytest.mark.skipif(
    not cpu_gemm.float32_panels_available(), reason="the panel kernel needs AVX2 and FMA"
)


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_bfloat16_only_where_the_cpu_computes_it(
    native: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(model_runner, "cpu_computes_bfloat16", lambda: native)
    monkeypatch.setattr(model_runner, "bfloat16_kernels", lambda: True)
    with caplog.at_level(logging.WARNING, logger=model_runner.__name__):
        assert resolve_dtype("auto", CPU) == (torch.bfloat16 if native else torch.float32)
        assert resolve_dtype("float32", CPU) == torch.float32
    assert caplog.records == []
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_auto_is_float32_on_a_path_without_our_bfloat16_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The avx512 path (AVX-512 without BF16): oneDNN computes bfloat16, but the int4 and 8-bit
    kernels' bfloat16 vector paths are not built there, so auto takes float32 (their float32 kernels)."""
    monkeypatch.setattr(model_runner, "cpu_computes_bfloat16", lambda: True)
    monkeypatch.setattr(model_runner, "bfloat16_kernels", lambda: False)
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16  # explicit: kept
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


def test_weights_are_packed_only_where_a_kernel_exists_for_their_dtype(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    weight = torch.zeros(8, 16, dtype=torch.bfloat16)
    onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    float32_packs = onednn or cpu_gemm.float32_panels_available()  # every x86 CPU
    monkeypatch.setattr(cpu_gemm, "cpu_computes_bfloat16", lambda: False)
    assert not cpu_gemm.packing_available(weight)
    assert cpu_gemm.packing_available(weight.float()) == float32_packs
    monkeypatch.setattr(cpu_gemm, "cpu_computes_bfloat16", lambda: True)
    assert cpu_gemm.packing_available(weight) == onednn
    assert cpu_gemm.packing_available(weight.float()) == float32_packs
    assert not cpu_gemm.packing_available(weight.half())


@needs_panels
@pytest.mark.parametrize("preferred", [True, False])
def test_float32_goes_to_panels_where_preferred_and_bfloat16_never(
    preferred: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_gemm, "float32_panels_preferred", lambda: preferred)
    packed = cpu_gemm.pack_weight(torch.ones(40, 24))
    assert packed.panels == preferred and packed.out_features == 40
    if preferred:
        assert packed.data.shape == (3, 24, 16)  # 40 outputs in 3 panels of 16
        assert torch.equal(packed.data[2, :, 8:], torch.zeros(24, 8))  # outputs 40..47 do not exist
    if cpu_gemm.packing_available(torch.ones(1, dtype=torch.bfloat16)):
        assert not cpu_gemm.pack_weight(torch.ones(40, 24, dtype=torch.bfloat16)).panels


def float64_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A few ulps of the sum of magnitudes: the float32 error of an in-order product (F.linear's own
    error on these cases is at most 2.3e-7 of it)."""
    magnitudes = x.abs().double() @ weight.abs().double().T  # [rows, out]
    return 1e-6 * (magnitudes if bias is None else magnitudes + bias.abs().double())


@needs_panels
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 12, 13, 16, 80, 300])
@pytest.mark.parametrize("with_bias", [True, False])
def test_float32_panels_match_float64_and_do_not_depend_on_the_batch(rows: int, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(100, 72, generator=generator)  # [out, in]: 100 outputs, the last panel ragged
    bias = torch.randn(100, generator=generator) if with_bias else None
    wide = torch.randn(rows, 90, generator=generator)
    x = wide[:, 5:77]  # [rows, 72]: rows 90 floats apart, read in place
    panels = cpu_gemm.pack_panels(weight)  # [7, 72, 16]
    out = torch.ops.tokenmill.f32_panel_linear(x, panels, bias, 100)  # [rows, 100]
    reference = torch.nn.functional.linear(
        x.double(), weight.double(), None if bias is None else bias.double()
    )
    assert out.dtype == torch.float32 and out.shape == (rows, 100)
    assert bool(((out.double() - reference).abs() <= float64_bound(x, weight, bias)).all())
    # Each output is one in-order sum: a row gives the same bits alone as in any batch.
    for row in {0, rows // 2, rows - 1}:
        alone = torch.ops.tokenmill.f32_panel_linear(x[row : row + 1], panels, bias, 100)  # [1, 100]
        assert torch.equal(alone[0], out[row])


@needs_panels
def test_float32_panels_refuse_mismatched_shapes() -> None:
    panels = cpu_gemm.pack_panels(torch.ones(40, 24))  # [3, 24, 16]
    with pytest.raises(RuntimeError, match="x has 23 features, the panels 24"):
        torch.ops.tokenmill.f32_panel_linear(torch.ones(2, 23), panels, None, 40)
    with pytest.raises(RuntimeError, match="3 panels cannot hold 49 output features"):
        torch.ops.tokenmill.f32_panel_linear(torch.ones(2, 24), panels, None, 49)
    with pytest.raises(RuntimeError, match="bias must be contiguous float32"):
        torch.ops.tokenmill.f32_panel_linear(torch.ones(2, 24), panels, torch.ones(41), 40)
    assert torch.ops.tokenmill.f32_panel_linear(torch.ones(0, 24), panels, None, 40).shape == (0, 40)


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
    assert bool(((packed.double() - reference).abs() <= float64_bound(x, weight, bias)).all())


@pytest.mark.skipif(
    not (row_kernel_available() and cpu_gemm.packing_available(torch.ones(1, dtype=torch.bfloat16))),
    reason="the bfloat16 row kernel needs AVX512-BF16 and oneDNN's bfloat16 packing",
)
def test_packed_bfloat16_layers_take_one_or_two_rows_on_the_row_kernel() -> None:
    """A packed bfloat16 layer (and LM head) multiplies steps of up to BF16_ROW_KERNEL_MAX_ROWS rows
    on the row kernel (the batch-invariant kernel's bits), larger ones on oneDNN; both within float
    rounding of float64."""
    from tokenmill.layers.embedding import LMHead
    from tokenmill.layers.linear import RowParallelLinear

    layer = RowParallelLinear(96, 40, bias=True, dtype=torch.bfloat16)
    layer.weight.data.copy_(torch.randn(40, 96) / 96**0.5)
    layer.bias.data.copy_(torch.randn(40))  # type: ignore[union-attr]
    layer.prepare_for_inference()
    head = LMHead(40, 96, torch.bfloat16)
    head.weight.data.copy_(layer.weight.data)
    head.prepare_for_inference()
    assert layer.packed_weight is not None and head.packed_weight is not None
    x = torch.randn(cpu_gemm.BF16_ROW_KERNEL_MAX_ROWS + 1, 96, dtype=torch.bfloat16)
    for rows in range(1, x.shape[0] + 1):
        small = rows <= cpu_gemm.BF16_ROW_KERNEL_MAX_ROWS
        row_kernel = torch.ops.tokenmill.batch_invariant_linear(x[:rows], layer.weight.data)  # [rows, 40]
        onednn = cpu_gemm.packed_linear(x[:rows], layer.packed_weight, None)
        assert torch.equal(head(x[:rows]), row_kernel if small else onednn)
        with_bias = (
            row_kernel + layer.bias
            if small
            else cpu_gemm.packed_linear(x[:rows], layer.packed_weight, layer.bias)
        )
        assert torch.equal(layer(x[:rows]), with_bias)
        reference = x[:rows].double() @ layer.weight.data.double().T
        assert torch.allclose(row_kernel.double(), reference, rtol=2**-7, atol=1e-2)
