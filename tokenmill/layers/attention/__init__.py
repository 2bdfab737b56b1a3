"""Paged attention backends (``AttentionBackend``) and the choice between them.

Every backend implements ``backend.AttentionBackend`` and is tested against the reference
(``TorchReferenceBackend``). ``auto`` picks the fastest one that works on the device; a fast backend
that cannot be used is announced with a warning at start-up, never swapped out silently.
"""

from __future__ import annotations

import functools
import logging

import torch

from tokenmill.config import attention_backend_choice
from tokenmill.layers.attention.backend import AttentionBackend, SequenceStep
from tokenmill.layers.attention.mla import MLAReferenceBackend
from tokenmill.layers.attention.torch_ref import TorchReferenceBackend

logger = logging.getLogger(__name__)


def select_backend(
    device: torch.device | str, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
) -> type[AttentionBackend]:
    """The attention backend class for activations of ``dtype`` on ``device``.

    ``TOKENMILL_ATTENTION_BACKEND`` (read in ``config``) forces one: ``torch`` the reference,
    ``cpu`` the C++ kernels (a ``RuntimeError`` if they cannot be built or the device is not a CPU).
    ``auto``: the C++ kernels on CPU when they build (else the reference, with a warning), the
    reference elsewhere for now. With ``kv_dtype`` (the cache's dtype, known to the model runner),
    a mix of activation and cache dtypes the CPU kernels do not read is announced: those layers
    attend through the reference's code.
    """
    backend = _select(torch.device(device).type, dtype, attention_backend_choice())
    if kv_dtype is not None and backend.name == "cpu":
        from tokenmill.layers.attention.cpu_paged import kernels_read

        if not kernels_read(dtype, kv_dtype):
            logger.warning(
                "a %s KV cache under %s activations attends through the torch reference, slower than the "
                "CPU kernels (they take the model's dtype, or a 16-bit cache under float32)",
                str(kv_dtype).removeprefix("torch."),
                str(dtype).removeprefix("torch."),
            )
    return backend


@functools.cache
def _select(device_type: str, dtype: torch.dtype, choice: str) -> type[AttentionBackend]:
    # Cached so a model's layers and the model runner share one decision and one log line.
    if choice == "torch":
        return _chosen(TorchReferenceBackend, "forced by TOKENMILL_ATTENTION_BACKEND")
    if choice == "cpu" and device_type != "cpu":
        raise RuntimeError(f"TOKENMILL_ATTENTION_BACKEND=cpu needs a CPU device, got {device_type}")
    if device_type != "cpu":
        return _chosen(TorchReferenceBackend, f"no fast backend for {device_type} yet")

    from tokenmill.layers import cpu_kernels
    from tokenmill.layers.attention.cpu_paged import KERNEL_DTYPES, CpuPagedBackend

    error = cpu_kernels.load_error()
    if error is None and dtype in KERNEL_DTYPES:
        return _chosen(CpuPagedBackend, f"C++ kernel for decode, {dtype}")
    reason = error or f"the kernel does not support {dtype}"
    if choice == "cpu":
        raise RuntimeError(
            f"TOKENMILL_ATTENTION_BACKEND=cpu but the CPU attention kernel is unusable: {reason}"
        )
    logger.warning("CPU attention kernel unavailable, falling back to the slower torch reference: %s", reason)
    return TorchReferenceBackend


def select_mla_backend(device: torch.device | str, dtype: torch.dtype) -> type[MLAReferenceBackend]:
    """Multi-head latent attention's backend: the absorbed decode on the CPU decode kernel where
    ``select_backend`` chooses the CPU kernels (``mla_cpu.py``), else the torch reference."""
    if select_backend(device, dtype).name == "cpu":
        from tokenmill.layers.attention.mla_cpu import MLACpuBackend

        return MLACpuBackend
    return MLAReferenceBackend


def _chosen(backend: type[AttentionBackend], why: str) -> type[AttentionBackend]:
    logger.info("attention backend: %s (%s)", backend.name, why)
    return backend


__all__ = [
    "AttentionBackend",
    "MLAReferenceBackend",
    "SequenceStep",
    "TorchReferenceBackend",
    "select_backend",
    "select_mla_backend",
]
