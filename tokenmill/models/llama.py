"""The Llama family: Llama 2/3, Mistral, Qwen2/2.5 (QKV bias), Qwen3 (q/k RMSNorm), Phi-3, SmolLM2.

One decoder definition; the differences between these architectures are configuration
(biases, head_dim, q/k norms, rope scaling, tied embeddings), read once in ``LlamaArgs``.
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
from tokenmill.layers.fused_decode_stack import FusedDecodeStack, LlamaLayerParts
from tokenmill.layers.linear import MergedColumnLinear, RowParallelLinear, head_rows
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import get_rope
from tokenmill.layers.tensor_parallel import SINGLE, TensorParallel
from tokenmill.models.base import CausalLM
from tokenmill.models.weights import load_hf_weights
from tokenmill.step_control import LayerProgress

QWEN_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")


@dataclass
class LlamaArgs:
    """The hyper-parameters this file reads from a Hugging Face config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    hidden_act: str
    sliding_window: int | None

    @classmethod
    def from_hf(cls, config) -> LlamaArgs:  # type: ignore[no-untyped-def]
        model_type = config.model_type
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        # Qwen2 always has QKV biases; Qwen2-MoE says so in `qkv_bias` (True by default).
        qkv_bias = model_type == "qwen2" or attention_bias or bool(getattr(config, "qkv_bias", False))
        windowed = model_type in ("mistral", "mixtral")
        sliding_window = getattr(config, "sliding_window", None) if windowed else None
        if model_type in QWEN_TYPES and getattr(config, "use_sliding_window", False):
            raise ValueError(
                f"{model_type} with use_sliding_window=True (per-layer windows) is not supported yet"
            )
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=qkv_bias,
            o_bias=attention_bias and model_type == "llama",
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            hidden_act=getattr(config, "hidden_act", "silu"),
            sliding_window=sliding_window,
        )


def _activation(name: str):  # type: ignore[no-untyped-def]
    if name == "silu":
        return F.silu
    if name in ("gelu", "gelu_pytorch_tanh"):
        return (lambda x: F.gelu(x, approximate="tanh")) if name.endswith("tanh") else F.gelu
    raise ValueError(f"unsupported hidden_act {name!r}")


class LlamaAttention(nn.Module):
    """Self-attention over this rank's query heads and the KV heads they read (all of them on one
    rank; under tensor parallelism a slice, or one replicated head: ``TensorParallel.kv_heads``)."""

    def __init__(
        self, args: LlamaArgs, rotary: nn.Module, dtype: torch.dtype, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        (first_q, self.num_heads), (first_kv, self.num_kv_heads) = tp.head_ranges(
            args.num_heads, args.num_kv_heads
        )
        self.head_dim = head_dim = args.head_dim
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_proj = MergedColumnLinear(
            args.hidden_size,
            {"q": q_size, "k": kv_size, "v": kv_size},
            bias=args.qkv_bias,
            dtype=dtype,
            tp=tp,
            shard_ranges=head_rows(first_q, self.num_heads, first_kv, self.num_kv_heads, head_dim),
        )
        self.o_proj = RowParallelLinear(
            q_size,
            args.hidden_size,
            bias=args.o_bias,
            dtype=dtype,
            tp=tp,
            in_range=(first_q * head_dim, self.num_heads * head_dim),
        )
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.rotary = rotary  # shared by every layer
        # The model is built under `with torch.device(...)`, so the default device is the target one.
        backend = select_backend(torch.get_default_device(), dtype)
        self.attn = backend(self.num_heads, self.num_kv_heads, args.head_dim, args.head_dim**-0.5)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, layer_index: int) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, kv_heads, head_dim]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, kv_heads, head_dim]
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rotary(batch.positions, q, k, batch.seq_lens)
        out = self.attn.forward(q, k, v, batch.kv_caches[layer_index], batch.attn)
        return self.o_proj(out.reshape(num_tokens, -1))  # [num_tokens, hidden_size]


class LlamaMLP(nn.Module):
    """The gated MLP; ``intermediate_size`` overrides the config's (MoE shared experts, dense layers)."""

    def __init__(
        self,
        args: LlamaArgs,
        dtype: torch.dtype,
        intermediate_size: int | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        size = intermediate_size or args.intermediate_size
        self.gate_up_proj = MergedColumnLinear(
            args.hidden_size, {"gate": size, "up": size}, bias=args.mlp_bias, dtype=dtype, tp=tp
        )
        self.down_proj = RowParallelLinear(size, args.hidden_size, bias=args.mlp_bias, dtype=dtype, tp=tp)
        self.act = _activation(args.hidden_act)
        self.hidden_act = args.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]
        if self.hidden_act == "silu" and fused_cpu.applies_to(gate_up):
            return self.down_proj(fused_cpu.silu_and_mul(gate_up))
        gate, up = self.gate_up_proj.split(gate_up)  # [num_tokens, intermediate] each
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and feed-forward with residuals; ``mlp`` is the feed-forward module
    (a mixture-of-experts block in the MoE families), a ``LlamaMLP`` when not given."""

    def __init__(
        self,
        args: LlamaArgs,
        rotary: nn.Module,
        dtype: torch.dtype,
        mlp: nn.Module | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = LlamaAttention(args, rotary, dtype, tp)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = mlp if mlp is not None else LlamaMLP(args, dtype, tp=tp)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, layer_index: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, batch, layer_index)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def fused_stack_parts(self) -> LlamaLayerParts | None:
        """This layer's parts for the fused CPU decoder stack (``layers/fused_decode_stack.py``, which
        decides whether they fit it), or None when its feed-forward is not a SiLU ``LlamaMLP``."""
        attention, mlp = self.self_attn, self.mlp
        if not isinstance(mlp, LlamaMLP) or mlp.hidden_act != "silu":
            return None
        q_norm, k_norm = attention.q_norm, attention.k_norm
        return LlamaLayerParts(
            input_norm=self.input_layernorm.weight,
            post_attention_norm=self.post_attention_layernorm.weight,
            q_norm=None if q_norm is None else q_norm.weight,
            k_norm=None if k_norm is None else k_norm.weight,
            attention=attention.attn,
            rotary=attention.rotary,
            projections=(attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj),
        )


class LlamaForCausalLM(CausalLM):
    """A Llama-family causal LM over a paged KV cache.

    ``forward`` returns hidden states for every token of the batch; ``compute_logits`` projects
    only the rows the caller needs (the last token of each sampling sequence), which is where most
    of a small model's time would otherwise go.
    """

    def __init__(self, config, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        args = LlamaArgs.from_hf(config)
        self.args = args
        self.tp = tp  # this rank's place in its tensor-parallel group (SINGLE: the whole model)
        self.embed_tokens = VocabEmbedding(args.vocab_size, args.hidden_size, dtype, tp)
        self.rotary = get_rope(config, args.head_dim)
        self.layers = nn.ModuleList(
            [
                LlamaDecoderLayer(args, self.rotary, dtype, self.build_mlp(config, args, index, dtype), tp)
                for index in range(args.num_layers)
            ]
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        tied = self.embed_tokens if args.tie_word_embeddings else None
        self.lm_head = LMHead(args.vocab_size, args.hidden_size, dtype, tied_to=tied, tp=tp)
        # The fused CPU decoder stack over all layers, when they fit it (see prepare_for_inference).
        self.decode_stack: FusedDecodeStack | None = None

    def build_mlp(self, config, args: LlamaArgs, layer_index: int, dtype: torch.dtype) -> nn.Module:  # type: ignore[no-untyped-def]
        """The feed-forward of layer ``layer_index`` (sharded over ``self.tp``); mixture-of-experts
        families override this."""
        return LlamaMLP(args, dtype, tp=self.tp)

    @property
    def sliding_window(self) -> int | None:
        """Mistral's (and Mixtral's) attention window (every layer), or None for full attention."""
        return self.args.sliding_window

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

    def prepare_for_inference(self) -> None:
        """Build the fused CPU decoder stack over every layer (all layers fit it, or it is not used);
        the model runner calls this once the weights are final."""
        args = self.args
        parts = [cast(LlamaDecoderLayer, layer).fused_stack_parts() for layer in self.layers]
        if self.tp.size > 1:  # its C++ loop has no collectives; the layers run one by one
            self.decode_stack = None
            return
        shape = (args.num_heads, args.num_kv_heads, args.head_dim)
        self.decode_stack = FusedDecodeStack.build(parts, self.norm.weight, shape, args.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor | LayerProgress:
        """Every token's final hidden state ``[num_tokens, hidden_size]``, or the ``LayerProgress``
        before the layer where ``batch.control`` stopped the pass; a paused pass goes on from
        ``batch.resume_from`` (step_control.py). The inputs of ``batch.aux_layers`` go to
        ``batch.aux_hidden`` (layer by layer then: the fused stack does not expose them)."""
        progress = batch.resume_from
        if progress is None:
            hidden = self.embed_tokens(batch.input_ids)  # [num_tokens, hidden_size]
            residual: torch.Tensor | None = None
            start = 0
        else:
            hidden, residual, start = progress.hidden, progress.residual, progress.next_layer
        if self.decode_stack is not None and not batch.aux_layers:  # the stack exposes no layer's input
            fused = self.decode_stack.run(hidden, batch)  # all layers and the norm in one C++ call
            if fused is not None:
                return fused
        for index in range(start, len(self.layers)):
            if batch.control.should_stop(index):  # a latency-critical arrival stops the step here
                return LayerProgress(index, hidden, residual)
            for _ in range(batch.aux_layers.count(index)):  # a small target may list a layer twice
                batch.aux_hidden.append(hidden if residual is None else hidden + residual)
            hidden, residual = self.layers[index](hidden, residual, batch, index)
        hidden, _ = self.norm(hidden, residual)
        return hidden  # [num_tokens, hidden_size]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [num_rows, vocab_size] activation dtype

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names) into this model; returns the names used.

        Separate q/k/v and gate/up checkpoint tensors go into the merged projections. Unknown names
        raise ValueError, so a checkpoint that does not match the architecture never loads silently.
        """
        return load_hf_weights(self, weights)
