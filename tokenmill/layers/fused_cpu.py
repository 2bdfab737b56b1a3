"""Fused CPU ops for the decoder layer (``tokenmill/csrc/fused_ops_cpu.cpp``), bfloat16 and float32.

A small model's decode step on a CPU is bound by operator overhead: the norms, rotary embedding and
MLP activation of one Llama layer cost about 40 ATen calls, the fused ops 4. They serve bfloat16 and
float32 CPU activations. In bfloat16 they follow transformers' rounding steps, so they differ only by
float32 summation order inside the RMS; in float32 that order is the only difference too (about one
ulp; the float32 model tests compare logits with transformers' to 1e-4, as the packed linears'
rounding order already requires). On a 2-core Zen 3 they took a float32 decode step of 16 sequences
(SmolLM2) from 155 to 127 ms of operator time: the plain path's ~400 small ATen calls cost ~25 ms.

``TOKENMILL_FUSED_CPU_OPS=0`` turns them off (see ``tokenmill.config.fused_cpu_ops_enabled``).
"""

from __future__ import annotations

import functools
import logging

import torch

from tokenmill.config import fused_cpu_ops_enabled
from tokenmill.layers.attention.metadata import DecodesAndChunks
from tokenmill.layers.cpu_kernels import load_error
from tokenmill.step_control import LayerProgress

logger = logging.getLogger(__name__)


@functools.cache
def _kernels_loaded() -> bool:
    if not fused_cpu_ops_enabled():
        logger.info("fused CPU ops disabled by TOKENMILL_FUSED_CPU_OPS=0")
        return False
    error = load_error()
    if error is not None:
        logger.warning("fused CPU ops unavailable, using unfused torch ops: %s", error)
        return False
    return True


def applies_to(x: torch.Tensor) -> bool:
    """Whether the fused ops serve ``x``: a bfloat16 or float32 CPU tensor, with the kernels built."""
    return x.dtype in (torch.bfloat16, torch.float32) and x.device.type == "cpu" and _kernels_loaded()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x)).to(x.dtype)`` over the last dim; ``x`` is ``[..., hidden]``."""
    rows = x.reshape(-1, x.shape[-1])  # [rows, hidden]
    return torch.ops.tokenmill.rms_norm(rows, weight, eps).view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + x), residual + x)``, computed in place in ``x`` and ``residual``
    (both ``[rows, hidden]`` with contiguous rows); the caller must not need their old values."""
    torch.ops.tokenmill.add_rms_norm(x, residual, weight, eps)
    return x, residual


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim] or [num_tokens, num_heads * head_dim]
    key: torch.Tensor,  # [num_tokens, kv_heads, head_dim] or flat
    cos_cache: torch.Tensor,  # [max_position, rotary_dim // 2] float32
    sin_cache: torch.Tensor,  # [max_position, rotary_dim // 2] float32
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first ``rotary_dim`` dims of each head ("rotate half" style) in place; returns the
    inputs. Heads must be contiguous within a token; tokens may be strided (views of a fused QKV)."""
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return query, key  # nothing to rotate (and no width to infer a flat view's from)
    flat_q = query.view(num_tokens, -1)  # [num_tokens, num_heads * head_dim]
    flat_k = key.view(num_tokens, -1)  # [num_tokens, kv_heads * head_dim]
    torch.ops.tokenmill.rotary_embedding(positions, flat_q, flat_k, cos_cache, sin_cache, head_dim)
    return query, key


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate).to(dtype) * up`` for ``gate_up = [gate | up]`` ``[rows, 2 * size]``."""
    return torch.ops.tokenmill.silu_and_mul(gate_up)  # [rows, size]


def gemma_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x / rms(x) * scale).to(x.dtype)`` over the last dim (``csrc/gemma_ops_cpu.cpp``), ``scale``
    being Gemma's ``1 + weight`` in float32; ``x`` is ``[rows, features]`` or ``[tokens, heads,
    features]`` with contiguous features (views of a fused QKV output too). A new contiguous tensor."""
    return torch.ops.tokenmill.gemma_rms_norm(x, scale, eps)


def add_gemma_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gemma_rms_norm(residual + x), residual + x)``, in place in ``x`` and ``residual`` (both
    ``[rows, features]`` with contiguous features); the caller must not need their old values."""
    torch.ops.tokenmill.add_gemma_rms_norm(x, residual, scale, eps)
    return x, residual


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate).to(dtype) * up`` for ``gate_up = [gate | up]`` ``[rows, 2 * size]``."""
    return torch.ops.tokenmill.gelu_tanh_and_mul(gate_up)  # [rows, size]


def llama_decode_stack(
    hidden: torch.Tensor,  # [S, hidden] bfloat16 or float32, contiguous: the embeddings; overwritten
    weights: list[torch.Tensor],  # every layer's, in order: see fused_decode_stack.FusedDecodeWeights
    biases: list[torch.Tensor | None],  # every layer's qkv, o, gate_up, down
    kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, kv_heads, head_dim]
    positions: torch.Tensor,  # [S] int64
    cos_cache: torch.Tensor,  # [max_position, rotary_dim // 2] float32
    sin_cache: torch.Tensor,  # [max_position, rotary_dim // 2] float32
    slot_mapping: torch.Tensor,  # [S] int64
    block_tables: torch.Tensor,  # [S, max_blocks] int64
    seq_lens: torch.Tensor,  # [S] int64
    final_norm: torch.Tensor,  # [hidden] hidden's dtype
    shape: tuple[int, int, int],  # (num_heads, num_kv_heads, head_dim)
    eps: float,
    scale: float,
    window: int | None,
    interrupt: torch.Tensor | None = None,  # [1] uint8 (step_control.py), polled between layers
    chunks: DecodesAndChunks | None = None,
    resume_from: LayerProgress | None = None,
    row_independent: bool = False,
) -> torch.Tensor | LayerProgress:
    """Every Llama decoder layer over a step of decodes with int4 projections (bfloat16) or float32
    panels (each with its bias, if any), then the final norm, in one C++ call
    (``csrc/decoder_layer_cpu.cpp``): the same kernels in the same order as the layer modules and the
    model's norm, so the same bits. Returns the final norm's output ``[S, hidden]``. If ``interrupt``
    is raised before a layer, returns the ``LayerProgress`` where the call stopped instead;
    ``resume_from`` (such a progress; ``hidden`` is then ignored) goes on from there, running at least
    one layer before it reads the flag again. With ``chunks``, ``block_tables`` and ``seq_lens`` are
    those of ``chunks.decode_rows`` and each of ``chunks.chunk_spans`` attends through the prefill
    kernel. ``row_independent`` (the deterministic mode; no ``chunks``): products on the int4 row kernel
    and decode attention on its vector path whatever the number of rows, so a row's bits do not
    depend on the other rows."""
    num_heads, num_kv_heads, head_dim = shape
    start_layer, residual = 0, None
    if resume_from is not None:
        hidden, start_layer = resume_from.hidden, resume_from.next_layer
        # [0] before the first layer: the call is resumed all the same (it runs a layer before it stops).
        residual = resume_from.residual if resume_from.residual is not None else hidden.new_empty(0)
    out, residual_out, next_layer = torch.ops.tokenmill.llama_decode_stack(
        hidden,
        weights,
        biases,
        kv_caches,
        positions,
        cos_cache,
        sin_cache,
        slot_mapping,
        block_tables,
        seq_lens,
        final_norm,
        num_heads,
        num_kv_heads,
        head_dim,
        eps,
        scale,
        window or 0,
        interrupt,
        None if chunks is None else chunks.chunk_spans,
        None if chunks is None else chunks.chunk_tables,
        None if chunks is None else chunks.decode_rows,
        start_layer,
        residual,
        row_independent,
    )  # [S, hidden] (the final norm's output, or the input of layer next_layer), [S, hidden] or [0], int
    if next_layer < len(kv_caches):
        return LayerProgress(next_layer, out, residual_out if residual_out.numel() else None)
    return out


def gemma_decode_stack(
    hidden: torch.Tensor,  # [S, hidden] bfloat16 or float32, contiguous: the scaled embeddings; updated
    weights: list[torch.Tensor],  # per layer its six norm scales, then its projections' tensors
    kinds: list[int],  # [4 L] each projection's kernel (gemma_decode_stack.KIND_*)
    out_features: list[int],  # [4 L]
    biases: list[torch.Tensor | None],  # [4 L]
    kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, kv_heads, head_dim]
    positions: torch.Tensor,  # [S] int64
    layer_kinds: list[int],  # [L] each layer's attention kind: an index into the per-kind lists
    cos_caches: list[torch.Tensor],  # per kind [max_position, rotary_dim // 2] float32
    sin_caches: list[torch.Tensor],  # per kind [max_position, rotary_dim // 2] float32
    slot_mappings: list[torch.Tensor],  # per kind [S] int64
    block_tables: list[torch.Tensor],  # per kind [S, max_blocks] int64
    seq_lens: list[torch.Tensor],  # per kind [S] int64
    windows: list[int],  # per kind, 0 for none
    final_norm: torch.Tensor,  # [hidden] float32 (1 + w)
    shape: tuple[int, int, int],  # (num_heads, num_kv_heads, head_dim)
    eps: float,
    scale: float,
    interrupt: torch.Tensor | None = None,  # [1] uint8 (step_control.py), polled between layers
    resume_from: LayerProgress | None = None,
) -> torch.Tensor | LayerProgress:
    """Every Gemma 3 decoder layer over a step of decodes (each row one sequence's), then the final
    norm, in one C++ call (``csrc/gemma_decoder_cpu.cpp``, whose header has the contract): the
    kernels the layer modules take, in their order, so the same bits. Returns the final norm's output
    ``[S, hidden]``, or the ``LayerProgress`` before the layer where a raised ``interrupt`` stopped
    it; ``resume_from`` (such a progress: its ``hidden`` is passed as ``hidden``) goes on from there,
    running at least one layer before it reads the flag again."""
    out, next_layer = torch.ops.tokenmill.gemma_decode_stack(
        hidden,
        weights,
        kinds,
        out_features,
        biases,
        kv_caches,
        positions,
        layer_kinds,
        cos_caches,
        sin_caches,
        slot_mappings,
        block_tables,
        seq_lens,
        windows,
        final_norm,
        *shape,
        eps,
        scale,
        interrupt,
        0 if resume_from is None else resume_from.next_layer,
        resume_from is not None,
    )  # [S, hidden]: the final norm's output, or the input of layer next_layer
    if next_layer < len(kv_caches):
        return LayerProgress(next_layer, out, None)
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for a 2-D CPU tensor with contiguous rows (first index on ties, NaN wins)."""
    return torch.ops.tokenmill.argmax_rows(x)  # [rows] int64


def argmax_applies_to(x: torch.Tensor) -> bool:
    """Whether ``argmax_rows`` serves ``x``: bfloat16 or float32 rows on CPU, with the kernels built."""
    return (
        x.dim() == 2
        and x.shape[1] > 0
        and x.stride(1) == 1
        and x.dtype in (torch.bfloat16, torch.float32)
        and x.device.type == "cpu"
        and _kernels_loaded()
    )
