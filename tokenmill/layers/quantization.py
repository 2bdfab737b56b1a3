"""Weight-only quantization for CPU linear layers (opt-in: ``--quantization int8`` or ``int4``).

This module checks the choice and holds int8; int4 (groups of 32 with a scale and a minimum, our own
kernel) is in layers/int4.py.

Each output row of a weight gets one symmetric scale (``max |w| / 127``) and int8 values. Decoding
one or a few sequences is a stream over the weights, so halving their bytes nearly halves the time of
those steps; torch's ``_weight_int8pack_mm`` does that product. Large batches are compute-bound and
that kernel is slow there, so they use the oneDNN bfloat16 path on the *dequantized* weights: every
batch size computes with the same (quantized) weight values, so outputs do not depend on which path
a step took. Quality against bfloat16 is measured by ``benchmarks/quantization_quality.py`` and
reported in docs/performance.md.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "int4")

# Up to this many rows a step uses the int8 kernel; above it the bfloat16 GEMM is faster.
INT8_MAX_ROWS = 16


def check_quantization(kind: str | None, dtype: torch.dtype, device: torch.device) -> None:
    """ValueError unless ``kind`` is None, ``none`` or a supported quantization for this dtype and
    device."""
    if kind is None or kind == "none":
        return
    if kind not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {kind!r}; choose one of {('none', *QUANTIZATIONS)}")
    if device.type != "cpu" or dtype != torch.bfloat16:
        raise ValueError(f"quantization {kind!r} needs dtype bfloat16 on CPU, got {dtype} on {device.type}")


def quantize_modules(model: nn.Module, kind: str | None, dtype: torch.dtype, device: torch.device) -> int:
    """Quantize (``check_quantization``'s ``kind``) every module of ``model`` that has
    ``quantize_weights``; returns how many did (0 for None or ``none``). A layer whose shape the
    format cannot hold keeps its weights, with a log line saying so."""
    check_quantization(kind, dtype, device)
    if kind is None or kind == "none":
        return 0
    count = 0
    for name, module in model.named_modules():
        quantize = getattr(module, "quantize_weights", None)
        if quantize is not None:
            skipped = quantize(kind)
            if skipped is None:
                count += 1
            else:
                logger.info("%s keeps its %s weights (not %s): %s", name, dtype, kind, skipped)
    return count


def quantize_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-row symmetric int8: ``(qweight [out, in] int8, scales [out] in weight's dtype)``.

    ``qweight * scales[:, None]`` approximates ``weight``; an all-zero row gets scale 1.
    """
    rows = weight.float()  # [out_features, in_features]
    scales = rows.abs().amax(dim=1) / 127.0  # [out_features]
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    # Round the scales to the activation dtype first: the kernel multiplies by the rounded value.
    scales = scales.to(weight.dtype)
    qweight = torch.round(rows / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return qweight, scales


def dequantize_int8_rows(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The weight the int8 kernel computes with, in the scales' dtype."""
    return (qweight.float() * scales.float()[:, None]).to(scales.dtype)  # [out_features, in_features]


def int8_rows(x: torch.Tensor, scales: torch.Tensor | None) -> bool:
    """Whether a layer quantized with ``scales`` (None: not quantized) takes ``x`` through the int8
    kernel: a 2-D input of 1 to ``INT8_MAX_ROWS`` rows in the scales' dtype."""
    return scales is not None and x.dim() == 2 and 0 < x.shape[0] <= INT8_MAX_ROWS and x.dtype == scales.dtype


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ (qweight * scales).T + bias`` for ``x`` ``[rows, in_features]`` in the scales' dtype."""
    out = torch._weight_int8pack_mm(x, qweight, scales)  # [rows, out_features]
    return out if bias is None else out + bias
