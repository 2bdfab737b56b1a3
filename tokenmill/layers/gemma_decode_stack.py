"""The fused CPU decoder stack of Gemma 3: every layer of a decode step and the final norm in one C++
call (``csrc/gemma_decoder_cpu.cpp``), the Gemma counterpart of ``fused_decode_stack.py``.

A Gemma 3 layer normalises six times, attends over its own window with its own rope, and its small
steps take whichever kernel each projection has (an exact 4-bit or 8-bit copy of a GGUF's layers, or
the bfloat16 row kernel): as modules that is ~25 Python-level calls a layer, about a quarter of
Gemma 3 270M's single-stream step. The model hands ``GemmaDecodeStack.build`` its layers' parts once
its weights are final; per step ``run`` either runs the whole stack or returns None and the model
runs its layer modules. It takes a step when the attention backend attends every row as a decode
with its kernel for each of the model's windows (``StackAttentionSource.stack_attention``, the rows
the modules' attention would attend the same way) and the rows fit every projection's small-step
kernel (``max_rows``). Each projection's kernel is the one ``LinearBase._matmul`` takes for such a
step, so the op gives the modules' bits: taking it or not changes no output.

A bfloat16 stack carries a ``wide`` one on the layers' oneDNN-packed weights (``KIND_ONEDNN``) for
steps with more rows than any projection's small-step kernel takes, where every module multiplies
with oneDNN's packed GEMM; steps between the two bounds (some projections still on a small-step
kernel) run the modules.

Not taken: tensor parallelism (no collectives in the C++ loop), LoRA (``lora/manager.py`` drops the
stack), the deterministic mode (a row-independent backend: ``with_backend`` gives None), steps with
prompt chunks on the prefill kernel, and layers whose projections have no small-step kernel here
(int8 ``--quantization``, oneDNN-packed float32).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.layers import fused_cpu
from tokenmill.layers.attention.backend import AttentionBackend
from tokenmill.layers.cpu_gemm import BF16_ROW_KERNEL_MAX_ROWS, bf16_row_weight
from tokenmill.layers.forward_batch import ForwardBatch
from tokenmill.layers.fused_decode_stack import PANELS_MAX_ROWS, StackAttentionSource
from tokenmill.layers.linear import LinearBase
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.step_control import LayerProgress

# The op's projection kinds (csrc/gemma_decoder_cpu.cpp).
KIND_INT4, KIND_Q8, KIND_BF16_ROWS, KIND_PANELS, KIND_LEVELS, KIND_ONEDNN = 0, 1, 2, 3, 4, 5


@dataclass
class GemmaLayerParts:
    """What the op reads of one Gemma 3 decoder layer: its six norms' float32 ``1 + w`` (input,
    post-attention, pre-feedforward, post-feedforward, then the per-head q and k norms), its
    attention backend, rotary embedding and window (None: global), and its projections
    ``(qkv, o, gate_up, down)``."""

    norm_scales: tuple[torch.Tensor | None, ...]
    attention: AttentionBackend
    rotary: nn.Module
    window: int | None
    projections: tuple[LinearBase, LinearBase, LinearBase, LinearBase]


@dataclass
class StackProjection:
    """One projection as the op takes it: its ``kind``, tensors, bias, outputs, and the most rows its
    small-step kernel takes."""

    kind: int
    tensors: list[torch.Tensor]
    bias: torch.Tensor | None
    out_features: int
    max_rows: int

    @classmethod
    def of(cls, linear: LinearBase, dtype: torch.dtype, wide: bool = False) -> StackProjection | None:
        """The kernel ``linear`` takes for small steps of ``dtype`` rows (``wide``: for steps above
        every bounded small-step kernel's rows, its oneDNN-packed bfloat16 weight, or the small-step
        kernel itself where that takes any number of rows, as int4 and level groups on their blocked
        copies do), or None when the op has none of its kind (sharded, int8, row-tiled for the
        deterministic mode, oneDNN-packed float32)."""
        if linear.tp_size != 1 or linear.row_tile or linear.weight.dtype != dtype:
            return None
        bf16 = dtype == torch.bfloat16
        if wide:
            small = cls.of(linear, dtype)
            if small is not None and small.max_rows >= PANELS_MAX_ROWS:
                return small  # what the module multiplies every step with
            onednn = linear.onednn_packed_bf16()
            if onednn is None:
                return None
            return cls(KIND_ONEDNN, [onednn], linear.bias, linear.out_features, PANELS_MAX_ROWS)
        int4, q8, levels, packed = (
            linear.int4_weight,
            linear.q8_weight,
            linear.level_weight,
            linear.packed_weight,
        )
        if int4 is not None:
            # Small steps: the blocked copy where the weight has one, as the module multiplies
            # (the Gemma stack has no row-independent form, whose row kernel needs the row layout).
            layout = int4.blocked() if bf16 else int4.blocked_f32()
            tensors, kind = list(layout or (int4.packed, int4.scales, int4.mins)), KIND_INT4
            max_rows = int4.max_rows if bf16 else int4.float32_max_rows
        elif linear.int8_weight is not None:
            return None
        elif q8 is not None:
            pair = (q8.q, q8.scales) if bf16 else q8.pair(q8.float32_max_rows, torch.float32)
            tensors, kind, max_rows = list(pair), KIND_Q8, q8.max_rows if bf16 else q8.float32_max_rows
        elif levels is not None and (bf16 or levels.float32_max_rows > 0):
            # As the module multiplies: the blocked copy where it has one; an empty fourth tensor: 4 bits.
            float32_layout = None if bf16 else levels.blocked_f32()
            packed_levels, level_scales, level_mins, fifth = (
                levels.kernel_tensors() if float32_layout is None else (*float32_layout, None)
            )
            high = fifth if fifth is not None else packed_levels.new_empty(0, dtype=torch.int32)
            tensors, kind, max_rows = (
                [packed_levels, level_scales, level_mins, high],
                KIND_LEVELS,
                levels.max_rows if bf16 else levels.float32_max_rows,
            )
        elif packed is not None and bf16 and bf16_row_weight(linear.weight):
            tensors, kind, max_rows = [linear.weight], KIND_BF16_ROWS, BF16_ROW_KERNEL_MAX_ROWS
        elif packed is not None and not bf16 and packed.panels:
            tensors, kind, max_rows = [packed.data], KIND_PANELS, PANELS_MAX_ROWS
        else:
            return None
        return cls(kind, tensors, linear.bias, linear.out_features, max_rows)


@dataclass
class GemmaDecodeStack:
    """The op's arguments that do not change between steps (see ``csrc/gemma_decoder_cpu.cpp``):
    the flat ``weights`` with each projection's ``kinds``, ``out_features`` and ``biases``, each
    layer's attention kind (``layer_kinds``, indexing ``windows`` and ``rotaries``), the final norm's
    scale, the head shape, the norms' epsilon, the backend that decides the steps, ``max_rows`` and
    the activations' ``dtype``."""

    weights: list[torch.Tensor]
    kinds: list[int]
    out_features: list[int]
    biases: list[torch.Tensor | None]
    layer_kinds: list[int]
    windows: list[int | None]
    rotaries: list[RotaryEmbedding]
    first_layers: list[int]  # per attention kind, its first layer (whose cache the backend checks)
    final_norm: torch.Tensor  # [hidden] float32
    shape: tuple[int, int, int]  # (num_heads, num_kv_heads, head_dim)
    eps: float
    backend: StackAttentionSource
    max_rows: int
    dtype: torch.dtype
    # The fewest rows it takes (the wide stack: one more than any small-step kernel of the layers).
    min_rows: int = 1
    # bfloat16: the same layers on their oneDNN-packed weights, for steps above every small-step
    # kernel's rows (None where a projection has no packed weight).
    wide: GemmaDecodeStack | None = None

    @classmethod
    def build(
        cls,
        parts: list[GemmaLayerParts],
        final_norm: torch.Tensor | None,
        shape: tuple[int, int, int],
        eps: float,
        dtype: torch.dtype,
        wide: bool = False,
    ) -> GemmaDecodeStack | None:
        """The stack over ``parts`` (every layer, in order) for ``dtype`` activations, or None unless
        every layer fits the op: its norms' scales prepared (float32), static rotary, an attention
        backend the stack attends through (not row-independent) and every projection with a
        small-step kernel (``wide``: one that takes any number of rows, or a oneDNN-packed bfloat16
        weight). A bfloat16 stack of small-step kernels of which some are bounded carries its ``wide``
        one where every projection has such a kernel or weight, from one row past the bounded kernels'
        widest step."""
        if not parts or final_norm is None or dtype not in (torch.bfloat16, torch.float32):
            return None
        backend = parts[0].attention
        if not isinstance(backend, StackAttentionSource) or backend.stack_row_independent:
            return None
        stack = cls([], [], [], [], [], [], [], [], final_norm, shape, eps, backend, PANELS_MAX_ROWS, dtype)
        widest = 0  # the most rows any projection's bounded kernel takes
        for index, layer in enumerate(parts):
            layer_widest = stack._add(index, layer, wide)
            if layer_widest is None:
                return None
            widest = max(widest, layer_widest)
        if not wide and dtype == torch.bfloat16 and stack.max_rows < PANELS_MAX_ROWS:
            stack.wide = cls.build(parts, final_norm, shape, eps, dtype, wide=True)
            if stack.wide is not None:
                stack.wide.min_rows = widest + 1
        return stack

    def _add(self, index: int, layer: GemmaLayerParts, wide: bool) -> int | None:
        """Appends ``layer``'s tensors; the most rows its projections' bounded kernels take (0 when
        every kernel takes any number), or None (nothing appended) when it does not fit the op."""
        rotary = layer.rotary
        if not isinstance(rotary, RotaryEmbedding) or rotary.dynamic is not None:
            return None
        if (
            not isinstance(layer.attention, StackAttentionSource)
            or layer.attention.scale != self.backend.scale
        ):
            return None
        scales = [s for s in layer.norm_scales if s is not None and s.dtype == torch.float32]
        if len(scales) != 6:
            return None
        projections = [StackProjection.of(linear, self.dtype, wide) for linear in layer.projections]
        if any(p is None for p in projections):
            return None
        self.weights += scales
        for projection in projections:
            assert projection is not None
            self.weights += projection.tensors
            self.kinds.append(projection.kind)
            self.out_features.append(projection.out_features)
            self.biases.append(projection.bias)
            self.max_rows = min(self.max_rows, projection.max_rows)
        kind = next(
            (
                k
                for k, (w, r) in enumerate(zip(self.windows, self.rotaries))
                if w == layer.window and r is rotary
            ),
            None,
        )
        if kind is None:
            kind = len(self.windows)
            self.windows.append(layer.window)
            self.rotaries.append(rotary)
            self.first_layers.append(index)
        self.layer_kinds.append(kind)
        # Kernels that take any number of rows run in the wide stack too: they do not bound its steps.
        return max(
            (p.max_rows for p in projections if p is not None and p.max_rows < PANELS_MAX_ROWS), default=0
        )

    @property
    def row_independent(self) -> bool:
        """Always False: a row-independent backend has no Gemma stack (``with_backend``)."""
        return self.backend.stack_row_independent

    def with_backend(self, backend: StackAttentionSource) -> GemmaDecodeStack | None:
        """This stack attending through ``backend``; None for a row-independent one (the deterministic
        mode runs Gemma's layer modules)."""
        if backend.stack_row_independent:
            return None
        wide = None if self.wide is None else self.wide.with_backend(backend)
        return dataclasses.replace(self, backend=backend, wide=wide)

    def run(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | LayerProgress | None:
        """Every remaining layer and the final norm over ``hidden`` (``[num_tokens, hidden_size]``: the
        scaled embeddings, or a paused pass's input at ``batch.resume_from``): the final norm's output,
        or the ``LayerProgress`` where ``batch.control``'s flag stopped the call; None when the step
        does not take the op (then the model runs its layer modules)."""
        num_tokens = hidden.shape[0]
        if num_tokens > self.max_rows and self.wide is not None and num_tokens >= self.wide.min_rows:
            return self.wide.run(hidden, batch)
        if (
            not self.min_rows <= num_tokens <= self.max_rows
            or hidden.dtype != self.dtype
            or not fused_cpu.applies_to(hidden)
        ):
            return None
        slots, tables, lens, windows = [], [], [], []
        for window, first in zip(self.windows, self.first_layers):
            metadata = batch.attention(window)
            rows = self.backend.stack_attention(metadata, num_tokens, hidden.dtype, batch.kv_caches[first])
            if rows is None or rows.chunks is not None:
                return None  # prompt chunks on the prefill kernel: the modules
            slots.append(metadata.slot_mapping)
            tables.append(rows.block_tables)
            lens.append(rows.seq_lens)
            windows.append(rows.sliding_window or 0)
        out = fused_cpu.gemma_decode_stack(
            hidden,
            self.weights,
            self.kinds,
            self.out_features,
            self.biases,
            batch.kv_caches,
            batch.positions,
            self.layer_kinds,
            [rotary.cos_cache for rotary in self.rotaries],
            [rotary.sin_cache for rotary in self.rotaries],
            slots,
            tables,
            lens,
            windows,
            self.final_norm,
            self.shape,
            self.eps,
            self.backend.scale,
            batch.control.flag_tensor,
            batch.resume_from,
        )  # [num_tokens, hidden_size], or where the flag stopped the call
        if isinstance(out, LayerProgress):
            batch.control.stopped_at(out.next_layer)
        return out
