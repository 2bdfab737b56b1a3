"""Paged attention backends and the choice between them.

Every backend has ``TorchPagedAttention``'s contract and is tested against it. ``auto`` picks the
fastest one that works on the device; a fast backend that cannot be used is announced with a
warning at start-up, never swapped out silently.
"""

from __future__ import annotations

import functools
import logging

import torch

from tokenmill.config import attention_backend_choice
from tokenmill.layers.attention.torch_ref import TorchPagedAttention

logger = logging.getLogger(__name__)


def select_attention_backend(device: torch.device, dtype: torch.dtype) -> type[TorchPagedAttention]:
    """The attention backend class for ``device`` and ``dtype``.

    ``TOKENMILL_ATTENTION_BACKEND`` (read in ``config``) forces one: ``torch`` the reference,
    ``cpu`` the C++ kernel (a ``RuntimeError`` if it cannot be built or the device is not a CPU).
    ``auto``: the C++ kernel on CPU when it builds (else the reference, with a warning), the
    reference elsewhere for now.
    """
    return _select(torch.device(device).type, dtype, attention_backend_choice())


@functools.cache
def _select(device_type: str, dtype: torch.dtype, choice: str) -> type[TorchPagedAttention]:
    # Cached so a model's layers share one decision and one warning.
    if choice == "torch":
        return _chosen(TorchPagedAttention, "forced by TOKENMILL_ATTENTION_BACKEND")
    if choice == "cpu" and device_type != "cpu":
        raise RuntimeError(f"TOKENMILL_ATTENTION_BACKEND=cpu needs a CPU device, got {device_type}")
    if device_type != "cpu":
        return _chosen(TorchPagedAttention, f"no fast backend for {device_type} yet")

    from tokenmill.layers import cpu_kernels
    from tokenmill.layers.attention.cpu_paged import KERNEL_DTYPES, CpuPagedAttention

    error = cpu_kernels.load_error()
    if error is None and dtype in KERNEL_DTYPES:
        return _chosen(CpuPagedAttention, f"C++ kernel for decode, {dtype}")
    reason = error or f"the kernel does not support {dtype}"
    if choice == "cpu":
        raise RuntimeError(
            f"TOKENMILL_ATTENTION_BACKEND=cpu but the CPU attention kernel is unusable: {reason}"
        )
    logger.warning("CPU attention kernel unavailable, falling back to the slower torch reference: %s", reason)
    return TorchPagedAttention


def _chosen(backend: type[TorchPagedAttention], why: str) -> type[TorchPagedAttention]:
    logger.info("attention backend: %s (%s)", backend.name, why)
    return backend


__all__ = ["TorchPagedAttention", "select_attention_backend"]
