"""The C++ segmented LoRA shrink/expand (``csrc/lora_cpu.cpp``), built and cached like the other CPU
kernels (``layers/cpu_kernels.py``: ``-march=native``, a folder under the extension cache keyed by
the sources, the flags, torch and the CPU) but as a library of its own, so the LoRA kernel neither
rebuilds nor waits for the attention kernels' library.

The kernel is written once against ``csrc/vec16.h``: AVX-512 where the CPU has it, else AVX2, else
plain loops. Where the build has AVX512-BF16 (``bf16_slots_available``: not under
``TOKENMILL_CPU_ISA=avx512`` or ``avx2``, whose flags take it away), a bfloat16 model's slots are
kept in bfloat16 (``slot_dtype``) and the kernel computes with ``vdpbf16ps``; elsewhere the slots
are float32. ``build_variant`` compiles it again under another op library with extra flags (a test
builds the AVX2 code on an AVX-512 machine and compares)."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from tokenmill.layers.cpu_kernels import build_library

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[1] / "csrc"
SOURCE = CSRC / "lora_cpu.cpp"
HEADERS = [CSRC / "vec16.h"]
NAME = "tokenmill_lora_cpu"
LIBRARY = "tokenmill_lora"


def _build(name: str, extra_flags: tuple[str, ...]) -> str | None:
    error = build_library(name, "lora_cpu", SOURCE, HEADERS, extra_flags)
    if error is not None:
        logger.warning("the LoRA CPU kernel is unavailable (the torch reference is used): %s", error)
    return error


@functools.cache
def load_error() -> str | None:
    """Builds (first time) and loads the kernel; None when it is ready, else why not (once per
    process: callers then use the torch reference, ``layers/lora.py``)."""
    return _build(NAME, ())


@functools.cache
def build_variant(library: str, flags: tuple[str, ...]) -> str | None:
    """Builds the kernel again as op library ``torch.ops.<library>`` with extra compiler ``flags``
    (e.g. ``-mno-avx512f``: the AVX2 code, as a CPU without AVX-512 runs it); None when loaded, else why not. For tests."""
    return _build(f"{NAME}_{library}", (*flags, f"-DTOKENMILL_LORA_LIBRARY={library}"))


@functools.cache
def bf16_slots_available(library: str = LIBRARY) -> bool:
    """Whether the kernel (or ``build_variant``'s ``library``) has its bfloat16-slot path."""
    if library == LIBRARY and load_error() is not None:
        return False
    return bool(getattr(torch.ops, library).bf16_slots_available())


def slot_dtype(activations: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype LoRA slots are kept in for a model computing in ``activations`` on ``device``:
    bfloat16 for bfloat16 on a CPU whose kernel has the bfloat16 path, else float32."""
    if device.type == "cpu" and activations == torch.bfloat16 and bf16_slots_available():
        return torch.bfloat16
    return torch.float32


def applies_to(x: torch.Tensor) -> bool:
    """Whether the kernel takes a step's input ``x``: on CPU, float32 or bfloat16, and built."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and load_error() is None


def lora_delta(
    out: torch.Tensor,  # [num_tokens, out_features], updated in place
    x: torch.Tensor,  # [num_tokens, in_features]
    lora_a: torch.Tensor,  # [slots, P * R, in_features] float32 or bfloat16
    lora_bt: torch.Tensor,  # [slots, R, out_features] lora_a's dtype
    ranks: torch.Tensor,  # [slots] int64
    row_slots: torch.Tensor,  # [num_tokens] int64, -1: no adapter
    piece_offsets: torch.Tensor,  # [P + 1] int64
    library: str = LIBRARY,
) -> None:
    """Add each row's adapter delta to ``out`` in one call (the contract of
    ``layers/lora.lora_delta_reference``; float32 accumulation, one rounding per output). bfloat16
    slots need bfloat16 ``x`` and ``bf16_slots_available``. Builds the
    kernel on first use; RuntimeError when it cannot. ``library``: a ``build_variant`` instead."""
    _op(library)(out, x.contiguous(), lora_a, lora_bt, ranks, row_slots, piece_offsets)


@functools.cache
def _op(library: str):  # type: ignore[no-untyped-def]
    """The op of ``library``, looked up once (a step calls it for every wrapped projection)."""
    error = load_error() if library == LIBRARY else None
    if error is not None:
        raise RuntimeError(f"the LoRA CPU kernel is unavailable: {error}")
    return getattr(torch.ops, library).lora_shrink_expand
