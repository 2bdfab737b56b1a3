"""The fused CPU decoder stack as a layer-level hook: a whole Llama-style stack in one C++ call.

A model hands the hook its layers' parts once its weights are final (``FusedDecodeStack.build``);
per step, ``run`` either runs every remaining layer and the final norm through
``fused_cpu.llama_decode_stack`` and returns the result, or returns None and the model runs its
layer modules. Which steps it takes is the attention backend's choice
(``CpuPagedBackend.stack_attention``: the rows its kernels attend as decodes, prompt chunks through
the prefill kernel or as decodes); the hook adds only what the op itself needs (every layer's
projections on the int4 kernel, or float32 panels, and few enough rows for them; a float32 model's
int4 layers take small steps on the int4 kernel and larger ones on their panels, a bfloat16 model's
larger ones on oneDNN's packed GEMM, as the modules do: the "wide" stack).
The op gives the same bits as the layer modules, so taking it or not changes no output.

A backend declares whether its stack attention is row-independent (``StackAttentionSource``): the
deterministic mode's ``DeterministicBackend`` does (every row a decode on the decode kernel's
vector path). A stack over such a backend runs the op with ``row_independent`` (int4 products on the
row kernel, never the AMX tiles) and exists only where that holds: a bfloat16 stack on the int4 row
kernel (``batch_invariant.row_kernel_available``). Its per-row arithmetic is then that of the
deterministic layer modules, so whether a step takes it (up to ``max_rows`` rows) or the modules
changes no bits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from tokenmill.layers import fused_cpu
from tokenmill.layers.attention.backend import AttentionBackend
from tokenmill.layers.attention.cpu_paged import StackAttention
from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.layers.batch_invariant import row_kernel_available
from tokenmill.layers.forward_batch import ForwardBatch
from tokenmill.layers.int4 import INT4_FLOAT32_MAX_ROWS, INT4_WIDE_MAX_ROWS
from tokenmill.layers.linear import LinearBase
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.step_control import LayerProgress

# The float32 panel kernel takes any number of rows; the fused stack then takes as many. One bound for
# every kernel that does (int4's wide kernel too), so that a stack's max_rows at it means "every step".
PANELS_MAX_ROWS = INT4_WIDE_MAX_ROWS


@runtime_checkable
class StackAttentionSource(Protocol):
    """An attention backend the fused stack can attend through: ``stack_attention`` gives a step's
    rows' attention arguments (or None: the step runs the layer modules), ``scale`` the softmax scale,
    and ``stack_row_independent`` declares whether the stack must run row-independently (the
    deterministic mode: every row a decode, no kernel chosen by the number of rows)."""

    scale: float
    stack_row_independent: bool

    def stack_attention(
        self, metadata: AttentionMetadata, num_tokens: int, dtype: torch.dtype, kv_cache: torch.Tensor
    ) -> StackAttention | None: ...


@dataclass
class LlamaLayerParts:
    """What the op reads of one pre-norm decoder layer with a SiLU gated MLP: the two norms' weights,
    the per-head q/k norms' weights (None without), its attention backend and rotary embedding, and
    its four projections ``(qkv, o, gate_up, down)``."""

    input_norm: torch.Tensor  # [hidden]
    post_attention_norm: torch.Tensor  # [hidden]
    q_norm: torch.Tensor | None  # [head_dim]
    k_norm: torch.Tensor | None  # [head_dim]
    attention: AttentionBackend
    rotary: nn.Module
    projections: tuple[LinearBase, LinearBase, LinearBase, LinearBase]


@dataclass
class FusedDecodeWeights:
    """One layer's tensors for ``fused_cpu.llama_decode_stack``: ``weights`` (both norms' weights, the
    projections' weights of qkv, o, gate_up and down — int4 ``(packed, scales, mins)`` each, float32
    panels in float32, oneDNN-packed weights in bfloat16 — then the q and k norms' weights if the
    layer has them),
    ``biases`` (those four projections' biases or None), ``max_rows``, the most rows its projections
    take, and ``dtype``, the activations' (bfloat16 or float32)."""

    weights: list[torch.Tensor]
    biases: list[torch.Tensor | None]
    max_rows: int
    dtype: torch.dtype

    @classmethod
    def of(
        cls, parts: LlamaLayerParts, int4: bool = True, blocked: bool = False
    ) -> FusedDecodeWeights | None:
        """The layer's tensors, or None unless it is exactly what the op computes: the CPU kernel
        attention, static rotary, no tensor parallelism, and either bfloat16 norms (q/k norms too, if
        any) with all four projections on the int4 kernel (when ``int4``) or on oneDNN-packed weights
        (otherwise: what ``LinearBase._matmul`` multiplies a step with more rows than the int4 kernel
        takes by), or float32 norms with all four on the int4 kernel (when ``int4``: a float32 model's
        exactly 4-bit layers) or on float32 panels (``layers/cpu_gemm.py``, CPUs without AVX-512).
        With ``blocked``, bfloat16 int4 projections pass their blocked copy where they have one
        (``Int4Weight.blocked``: what the modules multiply small steps with; not for the row kernel of
        a row-independent backend)."""
        if not isinstance(parts.attention, StackAttentionSource):
            return None
        rotary = parts.rotary
        if not isinstance(rotary, RotaryEmbedding) or rotary.dynamic is not None:
            return None
        norms = (parts.input_norm, parts.post_attention_norm)
        head_norms = () if parts.q_norm is None or parts.k_norm is None else (parts.q_norm, parts.k_norm)
        dtype = norms[0].dtype
        if dtype not in (torch.bfloat16, torch.float32) or any(
            w.dtype != dtype for w in (*norms, *head_norms)
        ):
            return None
        fused = cls(weights=list(norms), biases=[], max_rows=0, dtype=dtype)
        max_rows = []
        for linear in parts.projections:
            if linear.tp_size != 1 or linear.weight.dtype != dtype:
                return None
            int4_weight, packed = linear.int4_weight, linear.packed_weight
            if int4_weight is not None and int4:
                bf16 = dtype == torch.bfloat16
                layout = (int4_weight.blocked() if bf16 else int4_weight.blocked_f32()) if blocked else None
                fused.weights += list(layout or (int4_weight.packed, int4_weight.scales, int4_weight.mins))
                if bf16:
                    max_rows.append(int4_weight.max_rows)
                else:  # float32: as many rows as the modules take the layout passed for
                    max_rows.append(int4_weight.float32_max_rows if layout else INT4_FLOAT32_MAX_ROWS)
            elif not int4 and dtype == torch.bfloat16 and (onednn := linear.onednn_packed_bf16()) is not None:
                fused.weights.append(onednn)  # the wide stack
                max_rows.append(PANELS_MAX_ROWS)
            elif (
                dtype == torch.float32
                and linear.int8_weight is None
                and linear.level_weight is None  # whose small steps the module takes on its own kernel
                and packed is not None
                and packed.panels
            ):
                fused.weights.append(packed.data)
                max_rows.append(PANELS_MAX_ROWS)
            else:
                return None
            fused.biases.append(linear.bias)
        fused.weights += head_norms
        fused.max_rows = min(max_rows)
        return fused


@dataclass
class FusedDecodeStack:
    """The arguments of ``fused_cpu.llama_decode_stack`` that do not change between steps: every
    layer's ``weights`` and ``biases`` in layer order (``layers`` keeps them per layer),
    ``max_rows``, the most rows every layer's projections take, the activations' ``dtype``, and the
    model's shared parts (the first layer's backend, which decides the steps, the rotary tables,
    the final norm's weight, the head shape and the norms' epsilon)."""

    layers: list[FusedDecodeWeights]
    weights: list[torch.Tensor]
    biases: list[torch.Tensor | None]
    max_rows: int
    dtype: torch.dtype
    backend: StackAttentionSource
    rotary: RotaryEmbedding
    final_norm: torch.Tensor  # [hidden]
    shape: tuple[int, int, int]  # (num_heads, num_kv_heads, head_dim)
    eps: float
    # With int4 layers, for steps above max_rows: the same layers on their float32 panels (float32) or
    # their oneDNN-packed weights (bfloat16).
    wide: FusedDecodeStack | None = None
    # The layers it was built from: ``with_backend`` builds their tensors anew, since a row-independent
    # backend's row kernel takes the int4 weights' row layout, not the blocked copy.
    parts: list[LlamaLayerParts | None] = field(default_factory=list, repr=False)

    @classmethod
    def build(
        cls,
        parts: list[LlamaLayerParts | None],
        final_norm: torch.Tensor,
        shape: tuple[int, int, int],
        eps: float,
    ) -> FusedDecodeStack | None:
        """The stack of a model's layers (``parts`` in layer order; None for a layer that is not of
        this form), or None unless every layer fits the op and all are laid out alike (one dtype, the
        same number of weights each: the op reads one layout for all), in the final norm's dtype. A
        stack on int4 layers carries a ``wide`` one for larger steps, on their float32 panels or
        oneDNN-packed bfloat16 weights (where every layer has them), so a step of any size runs as one
        call: at 16 rows the layer modules spent ~6 of a ~29 ms SmolLM2 step in Python."""
        stack = cls._of(parts, final_norm, shape, eps, int4=True)
        if stack is not None and stack.max_rows < PANELS_MAX_ROWS and not stack.row_independent:
            stack.wide = cls._of(parts, final_norm, shape, eps, int4=False)
        return stack

    @classmethod
    def _of(
        cls,
        parts: list[LlamaLayerParts | None],
        final_norm: torch.Tensor,
        shape: tuple[int, int, int],
        eps: float,
        int4: bool,
        backend: StackAttentionSource | None = None,
    ) -> FusedDecodeStack | None:
        first = parts[0] if parts else None
        if first is None or not isinstance(first.attention, StackAttentionSource):
            return None  # (FusedDecodeWeights.of refuses such a layer too)
        backend = first.attention if backend is None else backend
        blocked = int4 and not backend.stack_row_independent
        per_layer = [None if p is None else FusedDecodeWeights.of(p, int4, blocked) for p in parts]
        layers = [layer for layer in per_layer if layer is not None]
        if not layers or len(layers) != len(per_layer):
            return None
        if (
            len({(layer.dtype, len(layer.weights)) for layer in layers}) != 1
            or final_norm.dtype != layers[0].dtype
        ):
            return None
        assert isinstance(first.rotary, RotaryEmbedding)
        stack = cls(
            layers=layers,
            weights=[tensor for layer in layers for tensor in layer.weights],
            biases=[bias for layer in layers for bias in layer.biases],
            max_rows=min(layer.max_rows for layer in layers),
            dtype=layers[0].dtype,
            backend=backend,
            rotary=first.rotary,
            final_norm=final_norm,
            shape=shape,
            eps=eps,
            parts=parts,
        )
        return stack.fitted()

    @property
    def row_independent(self) -> bool:
        """Whether each row's bits are independent of the step's other rows (the backend asks for it)."""
        return self.backend.stack_row_independent

    def fitted(self) -> FusedDecodeStack | None:
        """This stack as its backend needs it: unchanged, or for a row-independent backend the
        bfloat16 int4 stack with the row kernels built (else None). Steps above ``max_rows`` run the
        layer modules, whose bfloat16 row kernel gives the int4 row kernel's bits
        (``batch_invariant.invariant_product``)."""
        if not self.row_independent:
            return self
        if self.dtype != torch.bfloat16 or not row_kernel_available():
            return None
        return dataclasses.replace(self, wide=None)

    def with_backend(self, backend: StackAttentionSource) -> FusedDecodeStack | None:
        """The stack ``build`` made, attending through ``backend`` (``fitted`` to it), without a wide one."""
        return FusedDecodeStack._of(self.parts, self.final_norm, self.shape, self.eps, True, backend)

    def run(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | LayerProgress | None:
        """The decoder stack and the final norm over ``hidden`` (``[num_tokens, hidden_size]``: the
        embeddings, or a paused pass's input at ``batch.resume_from``) in one call when the backend
        attends this step's rows with its kernels and the rows fit every projection: the final norm's
        output ``[num_tokens, hidden_size]``, or the ``LayerProgress`` where ``batch.control``'s flag
        stopped it. None when the step does not take the op (the model runs its layer modules)."""
        num_tokens = hidden.shape[0]
        if num_tokens > self.max_rows and self.wide is not None:
            return self.wide.run(hidden, batch)
        if num_tokens > self.max_rows or hidden.dtype != self.dtype or not fused_cpu.applies_to(hidden):
            return None
        rows = self.backend.stack_attention(batch.attn, num_tokens, hidden.dtype, batch.kv_caches[0])
        if rows is None:
            return None
        out = fused_cpu.llama_decode_stack(
            hidden,
            self.weights,
            self.biases,
            batch.kv_caches,
            batch.positions,
            self.rotary.cos_cache,
            self.rotary.sin_cache,
            batch.attn.slot_mapping,
            rows.block_tables,
            rows.seq_lens,
            self.final_norm,
            self.shape,
            self.eps,
            self.backend.scale,
            rows.sliding_window,
            batch.control.flag_tensor,
            chunks=rows.chunks,
            resume_from=batch.resume_from,
            row_independent=self.row_independent,
        )  # [num_tokens, hidden_size], or where the flag stopped the call
        if isinstance(out, LayerProgress):
            batch.control.stopped_at(out.next_layer)
        return out
