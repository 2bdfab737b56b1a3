"""Qwen3-Next and Qwen3.5: hybrids of Gated DeltaNet (linear attention) and gated full-attention layers.

``config.layer_types`` says which layers are ``linear_attention`` (three of every four by default,
``full_attention_interval``) and which ``full_attention``. Only the full-attention layers use the
paged KV cache: ``num_layers`` counts them, and full-attention layer ``i`` of the stack writes KV
cache ``kv_index[i]``. Each linear layer keeps a fixed-size state per sequence instead (a slot of the
state pool: ``recurrent_state_layout``), read and written through ``batch.recurrent``.

As transformers' ``Qwen3NextForCausalLM`` computes it: Gemma-style RMSNorms (``1 + w``); the linear
layers project ``in_proj_qkvz`` and ``in_proj_ba`` (grouped per key head), run a depthwise causal
convolution with SiLU over q/k/v, the gated delta rule (``layers/gated_delta.py``) with L2-normalised
q/k, then a gated RMSNorm (``norm(o) * silu(z)``) and ``out_proj``; full attention has per-head q/k
norms, partial rotary and a sigmoid output gate carried in ``q_proj``'s second half; the feed-forward
is the Qwen MoE (softmax, top-k, optional renormalisation, a shared expert behind a sigmoid gate) on
sparse layers and a gated MLP elsewhere.

Qwen3.5's text models (``Qwen3_5ForCausalLM``, dense MLP; ``Qwen3_5MoeForCausalLM``, every layer
sparse, top-k always renormalised) are the same network with the linear layers' projections in four
plain matrices; its multimodal rotary sections give plain RoPE for text,
where the three position rows are equal.

The pass may stop only before its first layer: a linear layer updates its states in place, so a step
stopped after one could not be run again from the start.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.attention import select_backend
from tokenmill.layers.embedding import LMHead, VocabEmbedding
from tokenmill.layers.forward_batch import ForwardBatch
from tokenmill.layers.fused_moe import SparseMoeBlock, load_expert_tensors, softmax_then_topk
from tokenmill.layers.gated_delta import l2_normalize
from tokenmill.layers.linear import ColumnParallelLinear, MergedColumnLinear, RowParallelLinear
from tokenmill.layers.norm import GemmaRMSNorm
from tokenmill.layers.recurrent_kernel import (
    causal_conv,
    causal_conv_step,
    chunked_gated_delta,
    gated_delta_step,
)
from tokenmill.layers.recurrent_state import RecurrentBatch, RecurrentSequence
from tokenmill.layers.rotary import get_rope
from tokenmill.models.base import CausalLM
from tokenmill.models.llama import LlamaArgs, LlamaMLP
from tokenmill.models.qwen_moe import is_sparse_layer
from tokenmill.models.weights import load_hf_weights
from tokenmill.step_control import LayerProgress


class _DefaultIntermediate:
    """``config`` read through, with ``intermediate_size`` defaulting to ``moe_intermediate_size``."""

    def __init__(self, config) -> None:  # type: ignore[no-untyped-def]
        self._config = config

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        if name == "intermediate_size" and getattr(self._config, name, None) is None:
            return self._config.moe_intermediate_size
        return getattr(self._config, name)


class GatedRMSNorm(nn.Module):
    """``weight * rms_norm(x) * silu(z)`` over the last dim (normalised in float32, rounded to the
    input dtype before the weight, gated in float32), as Qwen3-Next's ``RMSNormGated``."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (self.weight * normed * F.silu(gate.float())).to(dtype)


class DepthwiseConv(nn.Module):
    """Holds the checkpoint's ``conv1d.weight`` ``[channels, 1, kernel]`` (no bias)."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel), requires_grad=False)


class GatedDeltaNet(nn.Module):
    """A linear-attention layer; its state per sequence is ``[conv_dim, kernel - 1]`` convolution
    inputs (model dtype) and ``[num_v_heads, k_head_dim, v_head_dim]`` float32."""

    def __init__(self, config, state_index: int, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.state_index = state_index
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.k_dim = config.linear_key_head_dim
        self.v_dim = config.linear_value_head_dim
        self.kernel = config.linear_conv_kernel_dim
        self.key_size = self.num_k_heads * self.k_dim
        self.value_size = self.num_v_heads * self.v_dim
        self.conv_dim = 2 * self.key_size + self.value_size
        hidden = config.hidden_size
        # Qwen3-Next projects q|k|v|z and b|a in two matrices grouped per key head; Qwen3.5 in four
        # plain ones (q|k|v for the convolution, z, b, a).
        self.separate_projections = config.model_type.startswith("qwen3_5")
        if self.separate_projections:
            self.in_proj_qkv = ColumnParallelLinear(hidden, self.conv_dim, dtype=dtype)
            self.in_proj_z = ColumnParallelLinear(hidden, self.value_size, dtype=dtype)
            self.in_proj_b = ColumnParallelLinear(hidden, self.num_v_heads, dtype=dtype)
            self.in_proj_a = ColumnParallelLinear(hidden, self.num_v_heads, dtype=dtype)
        else:
            self.in_proj_qkvz = ColumnParallelLinear(
                hidden, 2 * self.key_size + 2 * self.value_size, dtype=dtype
            )
            self.in_proj_ba = ColumnParallelLinear(hidden, 2 * self.num_v_heads, dtype=dtype)
        self.conv1d = DepthwiseConv(self.conv_dim, self.kernel)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(self.v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(self.value_size, hidden, dtype=dtype)

    def state_shapes(self, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [
            ((self.conv_dim, self.kernel - 1), dtype),
            ((self.num_v_heads, self.k_dim, self.v_dim), torch.float32),
        ]

    def _split_projections(
        self, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(mixed q|k|v [n, conv_dim], z [n, v_heads, v_dim], b [n, v_heads], a [n, v_heads])``: the
        projections are laid out per key head (each holding its q, k and its value heads' v, z)."""
        n = hidden.shape[0]
        if self.separate_projections:
            z = self.in_proj_z(hidden).view(n, self.num_v_heads, self.v_dim)  # [n, v_heads, v_dim]
            return self.in_proj_qkv(hidden), z, self.in_proj_b(hidden), self.in_proj_a(hidden)
        per_group = self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(hidden).view(n, self.num_k_heads, -1)  # [n, k_heads, group width]
        sizes = [self.k_dim, self.k_dim, per_group * self.v_dim, per_group * self.v_dim]
        q, k, v, z = torch.split(qkvz, sizes, dim=-1)
        ba = self.in_proj_ba(hidden).view(n, self.num_k_heads, 2 * per_group)  # [n, k_heads, 2 * group]
        b, a = torch.split(ba, [per_group, per_group], dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)  # [n, conv_dim]
        z = z.reshape(n, self.num_v_heads, self.v_dim)  # [n, v_heads, v_dim]
        return mixed, z, b.reshape(n, self.num_v_heads), a.reshape(n, self.num_v_heads)

    def _delta_inputs(
        self, conv_out: torch.Tensor, b: torch.Tensor, a: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """float32 ``(q, k [n, v_heads, k_dim], v [n, v_heads, v_dim], log_decay, beta [n, v_heads])``."""
        n = conv_out.shape[0]
        q, k, v = torch.split(conv_out, [self.key_size, self.key_size, self.value_size], dim=-1)
        repeat = self.num_v_heads // self.num_k_heads
        q = q.reshape(n, self.num_k_heads, self.k_dim).float().repeat_interleave(repeat, dim=1)
        k = k.reshape(n, self.num_k_heads, self.k_dim).float().repeat_interleave(repeat, dim=1)
        q = l2_normalize(q) * self.k_dim**-0.5  # [n, v_heads, k_dim]
        k = l2_normalize(k)  # [n, v_heads, k_dim]
        v = v.reshape(n, self.num_v_heads, self.v_dim).float()  # [n, v_heads, v_dim]
        beta = torch.sigmoid(b.float())  # [n, v_heads]
        log_decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # [n, v_heads]
        return q, k, v, log_decay, beta

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        state = batch.recurrent
        assert state is not None, "a linear-attention layer needs the batch's recurrent state"
        conv_states, delta_states = state.caches[self.state_index]
        mixed, z, b, a = self._split_projections(hidden)
        out = torch.empty(
            hidden.shape[0], self.num_v_heads, self.v_dim, dtype=hidden.dtype, device=hidden.device
        )
        weight = self.conv1d.weight[:, 0, :]  # [conv_dim, kernel]
        if state.decodes:
            self._decode(state, mixed, b, a, weight, conv_states, delta_states, out)
        for seq in state.prefills:
            self._prefill(seq, mixed, b, a, weight, conv_states, delta_states, out)
        n = hidden.shape[0]
        gated = self.norm(out, z).reshape(n, self.value_size)  # [n, value_size]
        return self.out_proj(gated)  # [n, hidden_size]

    def _decode(
        self,
        state: RecurrentBatch,
        mixed: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        weight: torch.Tensor,
        conv_states: torch.Tensor,
        delta_states: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        rows, slots = state.decode_rows, state.decode_slots
        conv_out, conv_states[slots] = causal_conv_step(mixed[rows], conv_states[slots], weight)
        q, k, v, log_decay, beta = self._delta_inputs(conv_out, b[rows], a[rows])
        core, delta_states[slots] = gated_delta_step(q, k, v, log_decay, beta, delta_states[slots])
        out[rows] = core.to(out.dtype)
        for seq in state.decodes:
            for _, snapshot in seq.checkpoints:
                conv_states[snapshot] = conv_states[seq.slot]
                delta_states[snapshot] = delta_states[seq.slot]

    def _prefill(
        self,
        seq: RecurrentSequence,
        mixed: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        weight: torch.Tensor,
        conv_states: torch.Tensor,
        delta_states: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        lo, hi = seq.first_row, seq.first_row + seq.num_tokens
        ends = sorted({offset for offset, _ in seq.checkpoints} | {seq.num_tokens})
        conv_out, conv_after = causal_conv(mixed[lo:hi], conv_states[seq.slot], weight, ends)
        q, k, v, log_decay, beta = self._delta_inputs(conv_out, b[lo:hi], a[lo:hi])
        s = delta_states[seq.slot]
        delta_after: dict[int, torch.Tensor] = {}
        start = 0
        for end in ends:  # segments end where a snapshot is wanted
            piece = slice(start, end)
            core, s = chunked_gated_delta(q[piece], k[piece], v[piece], log_decay[piece], beta[piece], s)
            out[lo + start : lo + end] = core.to(out.dtype)
            delta_after[end] = s
            start = end
        conv_by_end = dict(zip(ends, conv_after))
        for offset, snapshot in seq.checkpoints:
            conv_states[snapshot] = conv_by_end[offset]
            delta_states[snapshot] = delta_after[offset]
        conv_states[seq.slot] = conv_by_end[seq.num_tokens]
        delta_states[seq.slot] = s


class GatedAttention(nn.Module):
    """Full attention with per-head q/k Gemma norms, partial rotary and a sigmoid output gate."""

    def __init__(self, config, rotary: nn.Module, kv_index: int, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.kv_index = kv_index
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = MergedColumnLinear(
            config.hidden_size, {"q": 2 * q_size, "k": kv_size, "v": kv_size}, bias=bias, dtype=dtype
        )
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, bias=bias, dtype=dtype)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        backend = select_backend(torch.get_default_device(), dtype)
        self.attn = backend(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        n = hidden.shape[0]
        q_gate, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, gate = q_gate.view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)  # [n, heads, head_dim]
        q = self.q_norm(q.contiguous())
        k = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim))  # [n, kv_heads, head_dim]
        v = v.reshape(n, self.num_kv_heads, self.head_dim)  # [n, kv_heads, head_dim]
        q, k = self.rotary(batch.positions, q, k, batch.seq_lens)
        attn = self.attn.forward(q, k, v, batch.kv_caches[self.kv_index], batch.attn)
        attn = attn.reshape(n, -1) * torch.sigmoid(gate.reshape(n, -1))  # [n, heads * head_dim]
        return self.o_proj(attn)  # [n, hidden_size]


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(
        self, token_mixer: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, linear: bool
    ) -> None:
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.is_linear = linear
        if linear:
            self.linear_attn = token_mixer
        else:
            self.self_attn = token_mixer
        self.post_attention_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.mlp = mlp

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        mixer = self.linear_attn if self.is_linear else self.self_attn
        hidden = hidden + mixer(self.input_layernorm(hidden), batch)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3NextForCausalLM over the paged KV cache (full-attention layers) and the state pool."""

    def __init__(self, config, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.dtype = dtype
        self.layer_types: list[str] = list(config.layer_types)
        unknown = set(self.layer_types) - {"linear_attention", "full_attention"}
        if unknown:
            raise ValueError(f"unsupported Qwen3-Next layer types {sorted(unknown)}")
        # Qwen3.5-MoE has no dense MLP and so no `intermediate_size`: every layer is sparse.
        args = LlamaArgs.from_hf(_DefaultIntermediate(config))
        self.args = args
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.rotary = get_rope(config, args.head_dim)
        layers: list[nn.Module] = []
        self.kv_layers = 0
        self.linear_layers: list[GatedDeltaNet] = []
        for index, kind in enumerate(self.layer_types):
            mixer: nn.Module
            if kind == "linear_attention":
                mixer = GatedDeltaNet(config, len(self.linear_layers), dtype)
                self.linear_layers.append(mixer)
            else:
                mixer = GatedAttention(config, self.rotary, self.kv_layers, dtype)
                self.kv_layers += 1
            mlp = self._build_mlp(config, args, index, dtype)
            layers.append(
                Qwen3NextDecoderLayer(
                    mixer, mlp, config.hidden_size, config.rms_norm_eps, kind == "linear_attention"
                )
            )
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        tied = self.embed_tokens if args.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, dtype, tied_to=tied)

    @staticmethod
    def _build_mlp(config, args: LlamaArgs, index: int, dtype: torch.dtype) -> nn.Module:  # type: ignore[no-untyped-def]
        if not getattr(config, "num_experts", 0) or not is_sparse_layer(config, index):
            return LlamaMLP(args, dtype)
        shared_size = getattr(config, "shared_expert_intermediate_size", 0)
        shared = LlamaMLP(args, dtype, intermediate_size=shared_size) if shared_size else None
        route = functools.partial(
            softmax_then_topk,
            top_k=config.num_experts_per_tok,
            renormalize=bool(getattr(config, "norm_topk_prob", True)),  # Qwen3.5-MoE always renormalises
        )
        return SparseMoeBlock(
            config.hidden_size,
            config.num_experts,
            config.moe_intermediate_size,
            args.hidden_act,
            route,
            dtype,
            shared_expert=shared,
        )

    @property
    def num_layers(self) -> int:
        """The layers with a KV cache: the full-attention ones."""
        return self.kv_layers

    @property
    def num_kv_heads(self) -> int:
        return self.args.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.args.head_dim

    def recurrent_state_layout(self) -> list[list[tuple[tuple[int, ...], torch.dtype]]]:
        """Per linear layer, the shape (per slot) and dtype of each of its state tensors."""
        return [layer.state_shapes(self.dtype) for layer in self.linear_layers]

    def forward(self, batch: ForwardBatch) -> torch.Tensor | LayerProgress:
        """Every token's final hidden state ``[num_tokens, hidden_size]``. A stop is honoured only
        before the first layer (see the module docstring)."""
        if batch.resume_from is None and batch.control.should_stop(0):
            return LayerProgress(0, self.embed_tokens(batch.input_ids), None)
        hidden = self.embed_tokens(batch.input_ids)  # [num_tokens, hidden_size]
        for layer in self.layers:
            hidden = layer(hidden, batch)
        return self.norm(hidden)  # [num_tokens, hidden_size]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [num_rows, vocab_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Hugging Face tensors into this model; the multi-token-prediction head (``mtp.*``) is not
        used and skipped; unknown names raise ValueError."""
        loaded: set[str] = set()
        kept = ((name, tensor) for name, tensor in weights if not name.startswith("mtp."))
        rest = load_expert_tensors(self, kept, loaded)
        return loaded | load_hf_weights(self, rest)
