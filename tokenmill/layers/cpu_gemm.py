"""Pre-packed matrix multiplication on CPUs (oneDNN), for decode-sized batches.

``F.linear`` re-reads the weight in its plain layout on every call. oneDNN can reorder a weight once
into the blocked layout its AMX / AVX-512 / AVX2 kernels consume. bfloat16: on a 2-core Xeon that
makes the 64-256 row products of a decode step about 1.3-2x faster. float32: ``F.linear`` goes to
MKL's sgemm, which on AMD CPUs runs far below the machine (a 2-core Zen 3, SmolLM2's 30 layers:
166 ms at 16 rows, 348 at 64, 709 at 256), and oneDNN's AVX2 kernels take 81, 187 and 484 ms. Packed
results differ from ``F.linear`` only by float rounding order (about 1e-6 relative in float32). The
packed copy is kept beside the plain weight (embedding lookups, re-packing after weight updates
and the other paths read it), so packed layers hold their weights twice.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# The batch size oneDNN tunes the packed layout for: a typical decode step.
_PACK_BATCH_HINT = 128


def cpu_computes_bfloat16() -> bool:
    """Whether this CPU has bfloat16 instructions that oneDNN uses (AVX-512 BW/VL/DQ, AMX or
    AVX-NE-CONVERT). Without them (a plain AVX2 machine) bfloat16 products are emulated."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packing_available(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can use the packed path: a CPU tensor, a oneDNN build of torch, and either
    float32 or bfloat16 on a CPU whose bfloat16 oneDNN kernels exist (AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT; on a plain AVX2 machine oneDNN refuses to reorder a bfloat16 weight, so such
    layers keep ``F.linear``)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and cpu_computes_bfloat16())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight ``[out_features, in_features]`` reordered for :func:`packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` with a weight from :func:`pack_weight`; ``x`` is ``[rows, in_features]``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # [rows, out_features]
