"""The hybrid models' recurrent hot loops on C++ CPU kernels (``csrc/recurrent_cpu.cpp``), with the
torch reference (``layers/gated_delta.py``, ``layers/mamba2.py``) behind the same functions.

The functions here have the reference's signatures and contracts; the models import them from here.
Each runs the kernel when :func:`applies_to` its activations (CPU, float32 or bfloat16, the kernel
built, ``TOKENMILL_RECURRENT_KERNELS`` not ``0``: ``config.recurrent_kernels_enabled``), else the
reference. The kernels compute in float32 and keep float32 states; the scans go token by token (the
reference's prompt path is chunked), so results agree with the reference to float32 rounding.

Built and cached like the LoRA kernel (``cpu_kernels.build_library``): a library of its own under the
extension cache, keyed by its source, the flags (``TOKENMILL_CPU_ISA``'s path), torch and the CPU.
``build_variant`` compiles it again under another op library with extra flags (a test builds the AVX2
code on an AVX-512 machine and compares).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch

from tokenmill.config import recurrent_kernels_enabled
from tokenmill.layers import gated_delta as delta_reference
from tokenmill.layers import mamba2 as mamba_reference
from tokenmill.layers.cpu_kernels import build_library

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[1] / "csrc"
SOURCE = CSRC / "recurrent_cpu.cpp"
HEADERS = [CSRC / "vec16.h"]
NAME = "tokenmill_recurrent_cpu"
LIBRARY = "tokenmill_recurrent"


def _build(name: str, extra_flags: tuple[str, ...]) -> str | None:
    error = build_library(name, "recurrent_cpu", SOURCE, HEADERS, extra_flags)
    if error is not None:
        logger.warning("the recurrent CPU kernels are unavailable (the torch reference is used): %s", error)
    return error


@functools.cache
def load_error() -> str | None:
    """Builds (first time) and loads the kernels; None when ready, else why not (once per process)."""
    return _build(NAME, ())


@functools.cache
def build_variant(library: str, flags: tuple[str, ...]) -> str | None:
    """Builds the kernels again as op library ``torch.ops.<library>`` with extra compiler ``flags``
    (e.g. ``-mno-avx512f``: the AVX2 code); None when loaded, else why not. For tests."""
    return _build(f"{NAME}_{library}", (*flags, f"-DTOKENMILL_RECURRENT_LIBRARY={library}"))


def applies_to(x: torch.Tensor) -> bool:
    """Whether the kernels take activations ``x``: enabled, on CPU, float32 or bfloat16, and built."""
    return (
        recurrent_kernels_enabled()
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and load_error() is None
    )


def _ops(library: str) -> Any:
    return getattr(torch.ops, library)


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.float().contiguous()


def _owned_f32(x: torch.Tensor) -> torch.Tensor:
    """A contiguous float32 copy the kernel may update in place (never a view of the caller's)."""
    return x.to(torch.float32, copy=True).contiguous()


def causal_conv(
    inputs: torch.Tensor,  # [n, channels]
    state: torch.Tensor,  # [channels, kernel - 1]
    weight: torch.Tensor,  # [channels, kernel]
    ends: list[int],
    bias: torch.Tensor | None = None,  # [channels]
    library: str = LIBRARY,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``layers/gated_delta.causal_conv``'s contract (outputs ``[n, channels]``, states at ``ends``)."""
    if not applies_to(inputs):
        return delta_reference.causal_conv(inputs, state, weight, ends, bias)
    kernel = weight.shape[-1]
    full = torch.cat([state.transpose(0, 1).to(inputs.dtype), inputs], dim=0)  # [kernel - 1 + n, channels]
    weight_t = weight.float().t().contiguous()  # [kernel, channels]
    out = _ops(library).causal_conv(
        _f32(full), weight_t, None if bias is None else _f32(bias)
    )  # [n, channels]
    states = [full[e : e + kernel - 1].transpose(0, 1) for e in ends]  # each [channels, kernel - 1]
    return out.to(inputs.dtype), states


def causal_conv_step(
    inputs: torch.Tensor,  # [batch, channels]
    states: torch.Tensor,  # [batch, channels, kernel - 1]
    weight: torch.Tensor,  # [channels, kernel]
    bias: torch.Tensor | None = None,
    library: str = LIBRARY,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``layers/gated_delta.causal_conv_step``'s contract: SiLU outputs and the new states."""
    if not applies_to(inputs):
        return delta_reference.causal_conv_step(inputs, states, weight, bias)
    new_states = _owned_f32(states.to(inputs.dtype))  # the reference rounds the state to the inputs' dtype
    out = _ops(library).causal_conv_step(
        _f32(inputs), new_states, _f32(weight), None if bias is None else _f32(bias)
    )  # [batch, channels]
    return out.to(inputs.dtype), new_states.to(inputs.dtype)


def chunked_gated_delta(
    query: torch.Tensor,  # [n, heads, k_dim]
    key: torch.Tensor,  # [n, heads, k_dim]
    value: torch.Tensor,  # [n, heads, v_dim]
    log_decay: torch.Tensor,  # [n, heads]
    beta: torch.Tensor,  # [n, heads]
    state: torch.Tensor,  # [heads, k_dim, v_dim]
    library: str = LIBRARY,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``layers/gated_delta.chunked_gated_delta``'s contract, token by token in the kernel."""
    if not applies_to(query):
        return delta_reference.chunked_gated_delta(query, key, value, log_decay, beta, state)
    s = _owned_f32(state)[None]  # [1, heads, k_dim, v_dim]
    out = _ops(library).gated_delta(
        _f32(query)[None], _f32(key)[None], _f32(value)[None], _f32(log_decay)[None], _f32(beta)[None], s
    )  # [1, n, heads, v_dim]
    return out[0], s[0]


def gated_delta_step(
    query: torch.Tensor,  # [batch, heads, k_dim]
    key: torch.Tensor,  # [batch, heads, k_dim]
    value: torch.Tensor,  # [batch, heads, v_dim]
    log_decay: torch.Tensor,  # [batch, heads]
    beta: torch.Tensor,  # [batch, heads]
    state: torch.Tensor,  # [batch, heads, k_dim, v_dim]
    library: str = LIBRARY,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``layers/gated_delta.gated_delta_step``'s contract."""
    if not applies_to(query):
        return delta_reference.gated_delta_step(query, key, value, log_decay, beta, state)
    s = _owned_f32(state)
    out = _ops(library).gated_delta(
        _f32(query)[:, None],
        _f32(key)[:, None],
        _f32(value)[:, None],
        _f32(log_decay)[:, None],
        _f32(beta)[:, None],
        s,
    )  # [batch, 1, heads, v_dim]
    return out[:, 0], s


def chunked_scan(
    x: torch.Tensor,  # [n, heads, head_dim]
    dt: torch.Tensor,  # [n, heads]
    a: torch.Tensor,  # [heads]
    b: torch.Tensor,  # [n, heads, state_size]
    c: torch.Tensor,  # [n, heads, state_size]
    state: torch.Tensor,  # [heads, head_dim, state_size]
    chunk: int,
    library: str = LIBRARY,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``layers/mamba2.chunked_scan``'s contract (``chunk`` is the reference's block; the kernel goes
    token by token)."""
    if not applies_to(x):
        return mamba_reference.chunked_scan(x, dt, a, b, c, state, chunk)
    s = _owned_f32(state)[None]  # [1, heads, head_dim, state_size]
    y = _ops(library).ssd_scan(_f32(x)[None], _f32(dt)[None], _f32(a), _f32(b)[None], _f32(c)[None], s)
    return y[0], s[0]  # [n, heads, head_dim], [heads, head_dim, state_size]


def scan_step(
    x: torch.Tensor,  # [batch, heads, head_dim]
    dt: torch.Tensor,  # [batch, heads]
    a: torch.Tensor,  # [heads]
    b: torch.Tensor,  # [batch, heads, state_size]
    c: torch.Tensor,  # [batch, heads, state_size]
    state: torch.Tensor,  # [batch, heads, head_dim, state_size]
    library: str = LIBRARY,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``layers/mamba2.scan_step``'s contract."""
    if not applies_to(x):
        return mamba_reference.scan_step(x, dt, a, b, c, state)
    s = _owned_f32(state)
    y = _ops(library).ssd_scan(
        _f32(x)[:, None], _f32(dt)[:, None], _f32(a), _f32(b)[:, None], _f32(c)[:, None], s
    )  # [batch, 1, heads, head_dim]
    return y[:, 0], s
