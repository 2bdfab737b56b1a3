"""The C++ segmented LoRA shrink/expand (``csrc/lora_cpu.cpp``), built and cached like the other CPU
kernels (``layers/cpu_kernels.py``: ``-march=native``, a folder under the extension cache keyed by
the source, the flags, torch and the CPU) but as a library of its own, so the LoRA kernel neither
rebuilds nor waits for the attention kernels' library."""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

import torch

from tokenmill.config import extension_cache_dir
from tokenmill.layers.cpu_kernels import LDFLAGS, _cpu_flags, cflags, remove_stale_build_lock, stage_sources

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "lora_cpu.cpp"
NAME = "tokenmill_lora_cpu"


def _build_directory() -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes())
    for part in (" ".join((*cflags(), *LDFLAGS)), torch.__version__, _cpu_flags()):
        digest.update(part.encode())
    return Path(extension_cache_dir()) / f"lora_cpu-{digest.hexdigest()[:16]}"


@functools.cache
def load_error() -> str | None:
    """Builds (first time) and loads the kernel; None when it is ready, else why not (once per
    process: callers then use the torch reference, ``layers/lora.py``)."""
    try:
        from torch.utils import cpp_extension

        folder = _build_directory()
        folder.mkdir(parents=True, exist_ok=True)
        remove_stale_build_lock(folder)
        cpp_extension.load(
            name=NAME,
            sources=stage_sources(folder, [SOURCE]),
            extra_cflags=list(cflags()),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(folder),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a bad build: the torch reference is used
        logger.warning("the LoRA CPU kernel is unavailable (the torch reference is used): %s", exc)
        return f"{type(exc).__name__}: {exc}"
    return None


def applies_to(x: torch.Tensor) -> bool:
    """Whether the kernel takes a step's input ``x``: on CPU, float32 or bfloat16, and built."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and load_error() is None


def lora_delta(
    out: torch.Tensor,  # [num_tokens, out_features], updated in place
    x: torch.Tensor,  # [num_tokens, in_features]
    lora_a: torch.Tensor,  # [slots, P * R, in_features]
    lora_bt: torch.Tensor,  # [slots, R, out_features]
    ranks: torch.Tensor,  # [slots] int64
    row_slots: torch.Tensor,  # [num_tokens] int64, -1: no adapter
    piece_offsets: torch.Tensor,  # [P + 1] int64
) -> None:
    """Add each row's adapter delta to ``out`` in one call (the contract of
    ``layers/lora.lora_delta_reference``; float32 accumulation, one rounding per output). Builds the
    kernel on first use; RuntimeError when it cannot."""
    error = load_error()
    if error is not None:
        raise RuntimeError(f"the LoRA CPU kernel is unavailable: {error}")
    torch.ops.tokenmill_lora.lora_shrink_expand(
        out, x.contiguous(), lora_a, lora_bt, ranks, row_slots, piece_offsets
    )
