"""Pre-packed matrix multiplication on CPUs: oneDNN's blocked layouts, and float32 panels for AVX2.

``F.linear`` re-reads the weight in its plain layout on every call. Packing reorders it once into
the layout a kernel consumes. bfloat16 goes to oneDNN (AMX / AVX-512 kernels): on a 2-core Xeon
that makes the 64-256 row products of a decode step about 1.3-2x faster. float32: ``F.linear`` goes
to MKL's sgemm, which on AMD CPUs runs far below the machine (a 2-core Zen 3, SmolLM2's 30 layers:
166 ms at 16 rows, 348 at 64, 709 at 256). On CPUs without AVX-512 (where ``--dtype auto`` is
float32) the weight goes into 16-feature panels for ``csrc/f32_gemm_cpu.cpp`` (same Zen 3: 44 ms at
16 rows, 146 at 80, 463 at 256, against oneDNN's 70, 155, 452, and 24 against 41 at one row); with
AVX-512, or without the compiled kernels, to oneDNN's float32 layout. Packed results differ from
``F.linear`` only by float rounding order (about 1e-6 relative in float32). The packed copy is kept
beside the plain weight (embedding lookups, re-packing after weight updates and the other paths read
it), so packed layers hold their weights twice.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.layers.batch_invariant import row_kernel_available
from tokenmill.layers.cpu_isa import bfloat16_instructions, cpu_isa
from tokenmill.layers.cpu_kernels import load_error

logger = logging.getLogger(__name__)

# The batch size oneDNN tunes the packed layout for: a typical decode step.
_PACK_BATCH_HINT = 128
# Up to this many bfloat16 rows a dense bfloat16 weight multiplies faster on our row kernel
# (csrc/batch_invariant_gemm_cpu.cpp over group_gemm.h: one dot product per row and 32 weights) than
# on oneDNN: at one row 1.2-1.65x on Gemma 3 270M's and SmolLM2's shapes (2-core Zen 4: 34-42 GB/s of
# weights against 23-35), 1.1-1.5x at two; from four rows oneDNN is as fast or faster.
BF16_ROW_KERNEL_MAX_ROWS = 2
PANEL_WIDTH = 16  # output features per float32 panel (csrc/f32_gemm_cpu.cpp)


@dataclass(frozen=True)
class PackedWeight:
    """A weight ``[out_features, in_features]`` reordered for one kernel: ``panels`` (float32,
    ``[ceil(out / 16), in, 16]``, ``csrc/f32_gemm_cpu.cpp``) or else oneDNN's opaque layout."""

    data: torch.Tensor
    out_features: int
    panels: bool

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


def cpu_computes_bfloat16() -> bool:
    """Whether this CPU has bfloat16 instructions that oneDNN uses (AVX-512 BW/VL/DQ, AMX or
    AVX-NE-CONVERT) and the ``TOKENMILL_CPU_ISA`` path is above ``avx2``. Without them (a plain AVX2
    machine, or the ``avx2`` path) bfloat16 products are emulated."""
    isa = cpu_isa()
    return (isa is None or bfloat16_instructions()) and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def float32_panels_available() -> bool:
    """Whether the float32 panel kernel runs here: the CPU kernels built with AVX2 and FMA."""
    return load_error() is None and bool(torch.ops.tokenmill.f32_panels_available())


def float32_panels_preferred() -> bool:
    """Whether float32 weights go into panels rather than oneDNN's layout: the panel kernel runs and
    the path is ``avx2`` (the CPUs it was measured on; with AVX-512 oneDNN has wider kernels)."""
    return cpu_isa() == "avx2" and float32_panels_available()


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packing_available(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can use the packed path: a CPU tensor, and float32 (panels or oneDNN) or
    bfloat16 on a oneDNN build whose bfloat16 kernels exist on this CPU (AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT; on a plain AVX2 machine oneDNN refuses to reorder a bfloat16 weight, so such
    layers keep ``F.linear``)."""
    if weight.device.type != "cpu":
        return False
    if weight.dtype == torch.float32:
        return _onednn_available() or float32_panels_available()
    return weight.dtype == torch.bfloat16 and _onednn_available() and cpu_computes_bfloat16()


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` float32 as panels ``[ceil(out / 16), in, 16]``: panel ``p`` holds outputs
    ``16p .. 16p + 15`` (zeros past ``out``), the 16 weights of each input feature side by side."""
    out_features, in_features = weight.shape
    padded = F.pad(weight, (0, 0, 0, -out_features % PANEL_WIDTH))  # [num_panels * 16, in]
    return padded.view(-1, PANEL_WIDTH, in_features).transpose(1, 2).contiguous()  # [num_panels, in, 16]


def pack_weight(weight: torch.Tensor) -> PackedWeight:
    """The weight ``[out_features, in_features]`` reordered for :func:`packed_linear` (see
    :func:`packing_available`)."""
    out_features = weight.shape[0]
    if weight.dtype == torch.float32 and (float32_panels_preferred() or not _onednn_available()):
        return PackedWeight(pack_panels(weight), out_features, panels=True)
    return PackedWeight(
        torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT), out_features, False
    )


def bf16_row_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x @ weight.T`` ``[rows, out_features]`` on the bfloat16 row kernel for a step of 1 to
    ``BF16_ROW_KERNEL_MAX_ROWS`` bfloat16 CPU rows (contiguous features) and a contiguous bfloat16
    weight whose ``in_features`` is a multiple of 32, where the kernel is built; else None (the caller
    multiplies as before). Float32 accumulation in the kernel's order: the bits may differ from
    oneDNN's by float rounding, as oneDNN's own kernels differ between batch sizes."""
    if (
        x.dim() != 2
        or not 0 < x.shape[0] <= BF16_ROW_KERNEL_MAX_ROWS
        or x.dtype != torch.bfloat16
        or x.device.type != "cpu"
        or x.stride(1) != 1
        or not bf16_row_weight(weight)
    ):
        return None
    return torch.ops.tokenmill.batch_invariant_linear(x, weight)  # [rows, out_features]


def bf16_row_weight(weight: torch.Tensor) -> bool:
    """Whether :func:`bf16_row_linear` multiplies by ``weight``: a contiguous bfloat16 CPU weight whose
    ``in_features`` is a multiple of 32, with the row kernel built."""
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.shape[1] % 32 == 0
        and weight.is_contiguous()
        and row_kernel_available()
    )


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` with a weight from :func:`pack_weight`; ``x`` is ``[rows, in_features]``."""
    if packed.panels:
        x = x if x.stride(1) == 1 else x.contiguous()  # the kernel reads rows in place
        return torch.ops.tokenmill.f32_panel_linear(x, packed.data, bias, packed.out_features)  # [rows, out]
    return torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "none", [], "")  # [rows, out_features]
