"""Gemma 3 (text): sliding-window layers interleaved with global ones, computed as transformers does.

What sets it apart from the Llama family, each read from the Hugging Face config in ``Gemma3Args``:

- ``layer_types`` (from ``sliding_window_pattern``, every sixth layer global by default): a sliding
  layer attends to the last ``sliding_window`` positions and rotates with the local rope base
  (``rope_local_base_freq``, 10 000); a global layer sees everything and uses ``rope_theta`` with the
  config's rope scaling, which applies to global layers only.
- Gemma RMSNorm (``x / rms(x) * (1 + w)`` in float32) before and after both attention and MLP, and on
  each head's queries and keys.
- Attention scores scaled by ``query_pre_attn_scalar ** -0.5`` rather than ``head_dim ** -0.5``.
- A gelu-tanh gated MLP, embeddings multiplied by ``sqrt(hidden_size)`` rounded to the model dtype,
  tied embeddings, and an optional final logit soft-cap ``cap * tanh(logits / cap)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import fused_cpu
from tokenmill.layers.attention import select_backend
from tokenmill.layers.embedding import LMHead, VocabEmbedding
from tokenmill.layers.forward_batch import ForwardBatch
from tokenmill.layers.gemma_decode_stack import GemmaDecodeStack, GemmaLayerParts
from tokenmill.layers.linear import MergedColumnLinear, RowParallelLinear, head_rows
from tokenmill.layers.norm import GemmaRMSNorm
from tokenmill.layers.rotary import RotaryEmbedding, get_rope
from tokenmill.layers.tensor_parallel import SINGLE, TensorParallel
from tokenmill.models.base import CausalLM
from tokenmill.models.weights import load_hf_weights
from tokenmill.step_control import LayerProgress

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class Gemma3Args:
    """The hyper-parameters this file reads from a Hugging Face ``Gemma3TextConfig``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    hidden_act: str
    query_pre_attn_scalar: float
    layer_types: list[str]
    sliding_window: int
    final_logit_softcapping: float | None
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, config) -> Gemma3Args:  # type: ignore[no-untyped-def]
        """Read ``config``; ValueError for the variants whose semantics we do not reproduce."""
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention=True (an encoder) is not supported")
        if getattr(config, "attn_logit_softcapping", None) is not None:
            # Gemma 3 replaced Gemma 2's attention soft-cap with q/k norms; transformers' Gemma 3 never
            # applies the field, so honouring it would disagree with the reference and ignoring it
            # would be a silent change of what the config asks for.
            raise ValueError(
                "Gemma 3 config sets attn_logit_softcapping, which transformers' Gemma 3 does not apply; "
                "refusing to guess its meaning (set it to null)"
            )
        num_layers = int(config.num_hidden_layers)
        layer_types = list(getattr(config, "layer_types", None) or [])
        if not layer_types:
            pattern = int(getattr(config, "sliding_window_pattern", 6))
            layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
        if len(layer_types) != num_layers or set(layer_types) - {SLIDING, FULL}:
            raise ValueError(f"Gemma 3 layer_types must be {num_layers} of {SLIDING}/{FULL}: {layer_types}")
        sliding_window = getattr(config, "sliding_window", None)
        if SLIDING in layer_types and not sliding_window:
            raise ValueError("Gemma 3 config has sliding layers but no sliding_window")
        num_heads = int(config.num_attention_heads)
        return cls(
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // num_heads),
            rms_norm_eps=float(config.rms_norm_eps),
            attention_bias=bool(getattr(config, "attention_bias", False)),
            hidden_act=getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh",
            query_pre_attn_scalar=float(config.query_pre_attn_scalar),
            layer_types=layer_types,
            sliding_window=int(sliding_window or 0),
            final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
        )

    def window_of(self, layer_index: int) -> int | None:
        """The layer's attention window in positions, None for a global layer."""
        return self.sliding_window if self.layer_types[layer_index] == SLIDING else None


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class Gemma3Attention(nn.Module):
    def __init__(
        self,
        args: Gemma3Args,
        rotary: RotaryEmbedding,
        sliding_window: int | None,
        dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        # This rank's heads (``TensorParallel.kv_heads``: KV heads split, or replicated when fewer).
        (first_q, self.num_heads), (first_kv, self.num_kv_heads) = tp.head_ranges(
            args.num_heads, args.num_kv_heads
        )
        self.head_dim = head_dim = args.head_dim
        self.sliding_window = sliding_window
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_proj = MergedColumnLinear(
            args.hidden_size,
            {"q": q_size, "k": kv_size, "v": kv_size},
            bias=args.attention_bias,
            dtype=dtype,
            tp=tp,
            shard_ranges=head_rows(first_q, self.num_heads, first_kv, self.num_kv_heads, head_dim),
        )
        self.o_proj = RowParallelLinear(
            q_size,
            args.hidden_size,
            bias=args.attention_bias,
            dtype=dtype,
            tp=tp,
            in_range=(first_q * head_dim, self.num_heads * head_dim),
        )
        self.q_norm = GemmaRMSNorm(args.head_dim, args.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(args.head_dim, args.rms_norm_eps)
        self.rotary = rotary  # shared by every layer of the same type
        backend = select_backend(torch.get_default_device(), dtype)
        self.attn = backend(
            self.num_heads, self.num_kv_heads, args.head_dim, args.query_pre_attn_scalar**-0.5
        )

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, layer_index: int) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = self.q_norm(
            q.view(num_tokens, self.num_heads, self.head_dim)
        )  # [num_tokens, num_heads, head_dim]
        k = self.k_norm(
            k.view(num_tokens, self.num_kv_heads, self.head_dim)
        )  # [num_tokens, kv_heads, head_dim]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, kv_heads, head_dim]
        q, k = self.rotary(batch.positions, q, k, batch.seq_lens)
        metadata = batch.attention(self.sliding_window)
        out = self.attn.forward(q, k, v, batch.kv_caches[layer_index], metadata)
        return self.o_proj(out.reshape(num_tokens, -1))  # [num_tokens, hidden_size]


class Gemma3MLP(nn.Module):
    def __init__(self, args: Gemma3Args, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if args.hidden_act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"Gemma 3 with hidden_activation {args.hidden_act!r} is not supported")
        size = args.intermediate_size
        self.gate_up_proj = MergedColumnLinear(
            args.hidden_size, {"gate": size, "up": size}, dtype=dtype, tp=tp
        )
        self.down_proj = RowParallelLinear(size, args.hidden_size, bias=False, dtype=dtype, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]
        if fused_cpu.applies_to(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
            return self.down_proj(fused_cpu.gelu_tanh_and_mul(gate_up))  # [num_tokens, hidden_size]
        gate, up = self.gate_up_proj.split(gate_up)  # [num_tokens, intermediate] each
        return self.down_proj(_gelu_tanh(gate) * up)  # [num_tokens, hidden_size]


class Gemma3DecoderLayer(nn.Module):
    """Norms on both sides of each sub-layer: ``x + post(sub(pre(x)))`` for attention, then MLP."""

    def __init__(
        self,
        args: Gemma3Args,
        layer_index: int,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        eps = args.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(args.hidden_size, eps)
        self.self_attn = Gemma3Attention(args, rotary, args.window_of(layer_index), dtype, tp)
        self.post_attention_layernorm = GemmaRMSNorm(args.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(args.hidden_size, eps)
        self.mlp = Gemma3MLP(args, dtype, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(args.hidden_size, eps)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, layer_index: int) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), batch, layer_index)
        # The post-norm's output is added to the stream, then the sum is normalised for the MLP.
        normed, hidden = self.pre_feedforward_layernorm(self.post_attention_layernorm(attended), hidden)
        return hidden + self.post_feedforward_layernorm(self.mlp(normed))  # [num_tokens, hidden_size]

    def fused_stack_parts(self) -> GemmaLayerParts:
        """This layer's parts for the fused CPU decoder stack (``layers/gemma_decode_stack.py``, which
        decides whether they fit it)."""
        attention, mlp = self.self_attn, self.mlp
        norms = (
            self.input_layernorm,
            self.post_attention_layernorm,
            self.pre_feedforward_layernorm,
            self.post_feedforward_layernorm,
            attention.q_norm,
            attention.k_norm,
        )
        return GemmaLayerParts(
            norm_scales=tuple(norm.one_plus_weight for norm in norms),
            attention=attention.attn,
            rotary=attention.rotary,
            window=attention.sliding_window,
            projections=(attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj),
        )


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3's text decoder over a paged KV cache (transformers' ``Gemma3ForCausalLM``).

    ``layer_sliding_windows`` tells the model runner which attention metadata each layer needs;
    ``compute_logits`` projects only the rows the caller needs and applies the final soft-cap.
    """

    def __init__(self, config, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        args = Gemma3Args.from_hf(config)
        self.args = args
        self.tp = tp  # this rank's place in its tensor-parallel group (SINGLE: the whole model)
        self.embed_tokens = VocabEmbedding(args.vocab_size, args.hidden_size, dtype, tp)
        # transformers multiplies by sqrt(hidden_size) after rounding it to the weight dtype.
        self.embed_scale = float(torch.tensor(args.hidden_size**0.5).to(dtype))
        ropes = {
            layer_type: get_rope(config, args.head_dim, layer_type=layer_type)
            for layer_type in dict.fromkeys(args.layer_types)
        }
        self.rotary = nn.ModuleDict(ropes)
        self.layers = nn.ModuleList(
            [
                Gemma3DecoderLayer(args, i, ropes[args.layer_types[i]], dtype, tp)
                for i in range(args.num_layers)
            ]
        )
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        tied = self.embed_tokens if args.tie_word_embeddings else None
        self.lm_head = LMHead(args.vocab_size, args.hidden_size, dtype, tied_to=tied, tp=tp)
        # The fused CPU decoder stack over all layers, when they fit it (see prepare_for_inference).
        self.decode_stack: GemmaDecodeStack | None = None

    def prepare_for_inference(self) -> None:
        """Build the fused CPU decoder stack over every layer (all layers fit it, or it is not used);
        the model runner calls this once the weights (and the norms' derived scales) are final."""
        if self.tp.size > 1:  # its C++ loop has no collectives; the layers run one by one
            self.decode_stack = None
            return
        args = self.args
        parts = [cast(Gemma3DecoderLayer, layer).fused_stack_parts() for layer in self.layers]
        shape = (args.num_heads, args.num_kv_heads, args.head_dim)
        self.decode_stack = GemmaDecodeStack.build(
            parts, self.norm.one_plus_weight, shape, args.rms_norm_eps, self.embed_tokens.weight.dtype
        )

    @property
    def sliding_window(self) -> int | None:
        """A window shared by every layer, or None: the global layers see the whole sequence."""
        windows = set(self.layer_sliding_windows)
        return windows.pop() if len(windows) == 1 else None

    @property
    def layer_sliding_windows(self) -> list[int | None]:
        return [self.args.window_of(i) for i in range(self.args.num_layers)]

    @property
    def num_kv_heads(self) -> int:
        """The KV heads this rank caches (all of them with one rank)."""
        return self.tp.head_ranges(self.args.num_heads, self.args.num_kv_heads)[1][1]

    @property
    def head_dim(self) -> int:
        return self.args.head_dim

    @property
    def num_layers(self) -> int:
        return self.args.num_layers

    def forward(self, batch: ForwardBatch) -> torch.Tensor | LayerProgress:
        """Every token's final hidden state ``[num_tokens, hidden_size]``, or the ``LayerProgress``
        before the layer where ``batch.control`` stopped the pass."""
        progress = batch.resume_from
        if progress is None:
            embedded = self.embed_tokens(batch.input_ids)  # [num_tokens, hidden_size]
            hidden = embedded * torch.tensor(self.embed_scale, dtype=embedded.dtype)
            start = 0
        else:  # a paused pass goes on (step_control.py); the stream is the hidden state itself
            hidden, start = progress.hidden, progress.next_layer
        if self.decode_stack is not None:
            fused = self.decode_stack.run(hidden, batch)  # all layers and the norm in one C++ call
            if fused is not None:
                return fused
        for index in range(start, len(self.layers)):
            if batch.control.should_stop(index):  # a latency-critical arrival stops the step here
                return LayerProgress(index, hidden, None)
            hidden = self.layers[index](hidden, batch, index)
        return self.norm(hidden)  # [num_tokens, hidden_size]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()  # [num_rows, vocab_size]; soft-capped in float32
        cap = self.args.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (Hugging Face ``Gemma3ForCausalLM`` names); returns the names used.

        Norm weights are Gemma's offsets from one, as transformers stores them. Unknown names raise
        ValueError.
        """
        return load_hf_weights(self, weights)
