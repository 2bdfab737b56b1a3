"""DeepSeek-V3 (and Kimi K2, which ships the same architecture): multi-head latent attention over a
latent paged cache, DeepSeekMoE feed-forwards.

Attention (MLA, ``layers/attention/mla.py``): the query comes from a low-rank pair ``q_a_proj`` ->
``q_a_layernorm`` -> ``q_b_proj`` (or one ``q_proj`` when ``q_lora_rank`` is None); keys and values
from ``kv_a_proj_with_mqa``, which gives the compressed latent (normalised by ``kv_a_layernorm``)
and one rotary key shared by every head. The cache keeps just those two per token, so this model's
``kv_cache_spec`` is one plane of one head of ``kv_lora_rank + qk_rope_head_dim``. Rotary
dimensions are interleaved pairs in DeepSeek's checkpoints (``rope_interleave``); they are
de-interleaved before the usual rotate-half rotation, which is what transformers computes too. YaRN
scaling also multiplies the softmax scale by ``mscale(factor, mscale_all_dim)**2``.

Feed-forward: the first ``first_k_dense_replace`` layers are dense gated MLPs; the others route each
token to ``num_experts_per_tok`` of ``n_routed_experts`` experts (sigmoid scores; a per-expert
correction bias that changes which experts are chosen but not their weights; experts chosen within
the ``topk_group`` best of ``n_group`` groups; weights renormalised when ``norm_topk_prob`` and scaled
by ``routed_scaling_factor``), plus ``n_shared_experts`` shared experts (one MLP) for every token.

Tensor parallelism (``tp``): the attention heads split evenly over the ranks (``q_proj`` /
``q_b_proj`` and ``kv_b_proj`` column-parallel by head, ``o_proj`` row-parallel with its
all-reduce); ``q_a_proj``, ``kv_a_proj_with_mqa``, their norms and so the latent cache are whole on
every rank, as the latent is shared by all heads (each rank caches the full latent: MLA's cache does
not shrink with more ranks). Dense layers and shared experts split like Llama's MLP; the routed
experts split each expert's intermediate features, or with ``tp.expert_parallel`` whole experts
(``layers/fused_moe.py``). The router is whole on every rank, so every rank routes alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenmill.layers.attention import select_mla_backend
from tokenmill.layers.batch_invariant import row_tiled
from tokenmill.layers.embedding import LMHead, VocabEmbedding
from tokenmill.layers.forward_batch import ForwardBatch
from tokenmill.layers.fused_moe import FusedExperts, load_expert_tensors
from tokenmill.layers.linear import ColumnParallelLinear, RowParallelLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import get_rope, rope_parameters
from tokenmill.layers.tensor_parallel import SINGLE, TensorParallel
from tokenmill.models.base import CausalLM, KVCacheSpec
from tokenmill.models.llama import LlamaArgs, LlamaMLP
from tokenmill.models.weights import load_hf_weights
from tokenmill.step_control import LayerProgress


@dataclass
class DeepseekV3Args:
    """The hyper-parameters this file reads from a Hugging Face DeepSeek-V3 / Kimi K2 config."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    rope_interleave: bool
    softmax_scale: float
    tie_word_embeddings: bool
    first_k_dense_replace: int
    num_nextn_predict_layers: int

    @classmethod
    def from_hf(cls, config: Any) -> DeepseekV3Args:
        scoring = getattr(config, "scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ValueError(
                f"DeepSeek-V3 routing with scoring_func={scoring!r} is not supported (sigmoid only)"
            )
        qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            rms_norm_eps=config.rms_norm_eps,
            attention_bias=bool(getattr(config, "attention_bias", False)),
            rope_interleave=bool(getattr(config, "rope_interleave", True)),
            softmax_scale=softmax_scale(config, qk_head_dim),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            first_k_dense_replace=int(getattr(config, "first_k_dense_replace", 0) or 0),
            num_nextn_predict_layers=int(getattr(config, "num_nextn_predict_layers", 0) or 0),
        )


def softmax_scale(config: Any, qk_head_dim: int) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN scaling (MLA
    scales every query/key dimension, not only the rotary ones the YaRN attention factor covers)."""
    scale = qk_head_dim**-0.5
    params = rope_parameters(config)
    mscale_all_dim = params.get("mscale_all_dim")
    if params["rope_type"] != "default" and mscale_all_dim:
        factor = (
            params.get("factor")
            or config.max_position_embeddings / params["original_max_position_embeddings"]
        )
        mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def mlp_args(config: Any) -> LlamaArgs:
    """What ``LlamaMLP`` reads, for DeepSeek's dense layers and shared experts."""
    return LlamaArgs(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=1,
        head_dim=config.qk_nope_head_dim + config.qk_rope_head_dim,
        rms_norm_eps=config.rms_norm_eps,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        tie_word_embeddings=False,
        hidden_act=config.hidden_act,
        sliding_window=None,
    )


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``[..., (x0, x1), (x2, x3), ...]`` -> ``[..., x0, x2, ..., x1, x3, ...]``: DeepSeek's interleaved
    rotary pairs in the rotate-half layout."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class DeepseekV3Attention(nn.Module):
    """Multi-head latent attention; the step's attention runs in an MLA backend (``layers/attention/mla.py``)."""

    def __init__(
        self, args: DeepseekV3Args, rotary: nn.Module, dtype: torch.dtype, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.args = args
        # This rank's heads (all of them with one rank); ValueError when they do not split evenly.
        self.num_heads = tp.even_range(args.num_heads, "the attention heads")[1]
        heads, qk_head_dim = args.num_heads, args.qk_nope_head_dim + args.qk_rope_head_dim
        bias = args.attention_bias
        self.q_proj: ColumnParallelLinear | None = None
        self.q_a_proj: ColumnParallelLinear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: ColumnParallelLinear | None = None
        if args.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(args.hidden_size, heads * qk_head_dim, dtype=dtype, tp=tp)
        else:
            self.q_a_proj = ColumnParallelLinear(args.hidden_size, args.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(args.q_lora_rank, heads * qk_head_dim, dtype=dtype, tp=tp)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(
            args.hidden_size, args.kv_lora_rank + args.qk_rope_head_dim, bias=bias, dtype=dtype
        )
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, args.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(
            args.kv_lora_rank, heads * (args.qk_nope_head_dim + args.v_head_dim), dtype=dtype, tp=tp
        )
        self.o_proj = RowParallelLinear(
            heads * args.v_head_dim, args.hidden_size, bias=bias, dtype=dtype, tp=tp
        )
        self.rotary = rotary  # shared by every layer
        # The model is built under `with torch.device(...)`, so the default device is the target one.
        backend = select_mla_backend(torch.get_default_device(), dtype)
        self.attn = backend(
            self.num_heads,
            args.kv_lora_rank,
            args.qk_nope_head_dim,
            args.qk_rope_head_dim,
            args.v_head_dim,
            args.softmax_scale,
            self.kv_b_proj,
        )

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, layer_index: int) -> torch.Tensor:
        args = self.args
        num_tokens = hidden.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(hidden)  # [num_tokens, heads * qk_head_dim]
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(num_tokens, self.num_heads, -1)  # [num_tokens, local heads, qk_head_dim]
        q_nope, q_rope = q.split([args.qk_nope_head_dim, args.qk_rope_head_dim], dim=-1)
        compressed = self.kv_a_proj_with_mqa(hidden)  # [num_tokens, kv_lora_rank + rope]
        latent, k_rope = compressed.split([args.kv_lora_rank, args.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())  # [num_tokens, kv_lora_rank]
        k_rope = k_rope.reshape(num_tokens, 1, args.qk_rope_head_dim)  # [num_tokens, 1, rope]
        if args.rope_interleave:
            q_rope, k_rope = _deinterleave(q_rope), _deinterleave(k_rope)
        q_rope, k_rope = self.rotary(
            batch.positions, q_rope.contiguous(), k_rope.contiguous(), batch.seq_lens
        )
        out = self.attn.forward(
            q_nope, q_rope, latent, k_rope.view(num_tokens, -1), batch.kv_caches[layer_index], batch.attn
        )  # [num_tokens, heads, v_head_dim]
        return self.o_proj(out.reshape(num_tokens, -1))  # [num_tokens, hidden_size]


class DeepseekV3Router(nn.Module):
    """Sigmoid scoring with grouped top-k selection (see the module docstring). Its weight and
    correction bias stay float32 under ``module.to(dtype)``, as transformers keeps them."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.num_groups = config.n_group or 1
        self.topk_group = config.topk_group or 1
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        if num_experts % self.num_groups:
            raise ValueError(
                f"n_routed_experts={num_experts} does not split into n_group={self.num_groups} groups"
            )
        self.weight = nn.Parameter(torch.empty(num_experts, config.hidden_size), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)
        self.row_tile = 0  # deterministic mode: the scores in row tiles (layers/batch_invariant.py)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [num_tokens, top_k] float32, expert_ids [num_tokens, top_k] int64)``."""
        # In row tiles the sigmoid runs on whole tiles too: a vectorised transcendental gives other
        # bits on a tensor's scalar tail, so its row count must not vary either.
        scores = (
            row_tiled(self._scores, hidden.float(), self.row_tile)
            if self.row_tile
            else self._scores(hidden.float())
        )  # [T, E]
        for_choice = scores + self.e_score_correction_bias  # [T, E]: the bias only picks experts
        if self.num_groups > 1:
            grouped = for_choice.view(for_choice.shape[0], self.num_groups, -1)  # [T, G, E / G]
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
            best_groups = group_scores.topk(self.topk_group, dim=-1)[1]  # [T, topk_group]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
            for_choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).flatten(1)  # [T, E]
        expert_ids = for_choice.topk(self.top_k, dim=-1)[1]  # [T, top_k]
        weights = scores.gather(1, expert_ids)  # [T, top_k]
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, expert_ids

    def _scores(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(torch.nn.functional.linear(hidden, self.weight))  # [T, E]

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> DeepseekV3Router:
        super()._apply(fn, recurse)
        for parameter in (self.weight, self.e_score_correction_bias):
            if parameter.dtype != torch.float32:
                parameter.data = parameter.data.float()
        return self


class DeepseekV3MoE(nn.Module):
    """Routed experts plus the shared experts, added for every token. Under tensor parallelism the
    routed experts' partial sums are all-reduced here; the shared experts' ``down_proj`` reduces its own."""

    def __init__(self, config: Any, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.gate = DeepseekV3Router(config)
        self.experts = FusedExperts(
            config.n_routed_experts,
            config.hidden_size,
            config.moe_intermediate_size,
            config.hidden_act,
            dtype,
            tp=tp,
        )
        shared_size = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = (
            LlamaMLP(mlp_args(config), dtype, intermediate_size=shared_size, tp=tp) if shared_size else None
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.gate(hidden)  # [num_tokens, top_k] each
        out = self.tp.all_reduce(self.experts(hidden, weights, expert_ids))  # [num_tokens, hidden_size]
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out


class DeepseekV3DecoderLayer(nn.Module):
    """Pre-norm MLA and feed-forward (dense or DeepSeekMoE) with residuals."""

    def __init__(
        self,
        config: Any,
        args: DeepseekV3Args,
        rotary: nn.Module,
        layer_index: int,
        dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = DeepseekV3Attention(args, rotary, dtype, tp)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        dense = layer_index < args.first_k_dense_replace or not config.n_routed_experts
        self.mlp: nn.Module = (
            LlamaMLP(mlp_args(config), dtype, tp=tp) if dense else DeepseekV3MoE(config, dtype, tp)
        )

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


class DeepseekV3ForCausalLM(CausalLM):
    """DeepseekV3ForCausalLM (DeepSeek-V3, R1, Kimi K2) over a latent paged KV cache; ``tp``: this
    rank's shard (see the module docstring; SINGLE: the whole model)."""

    def __init__(self, config: Any, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        args = DeepseekV3Args.from_hf(config)
        self.args = args
        self.tp = tp
        self.embed_tokens = VocabEmbedding(args.vocab_size, args.hidden_size, dtype, tp)
        self.rotary = get_rope(config, args.qk_rope_head_dim)
        self.layers = nn.ModuleList(
            [DeepseekV3DecoderLayer(config, args, self.rotary, i, dtype, tp) for i in range(args.num_layers)]
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        tied = self.embed_tokens if args.tie_word_embeddings else None
        self.lm_head = LMHead(args.vocab_size, args.hidden_size, dtype, tied_to=tied, tp=tp)

    @property
    def num_layers(self) -> int:
        return self.args.num_layers

    @property
    def num_kv_heads(self) -> int:
        return 1  # one latent "head" per token, shared by every query head

    @property
    def head_dim(self) -> int:
        return self.args.kv_lora_rank + self.args.qk_rope_head_dim

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """One plane (the latent and the rotary key side by side), not separate keys and values."""
        return KVCacheSpec(num_kv_heads=1, head_dim=self.head_dim, num_planes=1)

    def forward(self, batch: ForwardBatch) -> torch.Tensor | LayerProgress:
        """Every token's final hidden state ``[num_tokens, hidden_size]``, or the ``LayerProgress``
        before the layer where ``batch.control`` stopped the pass (``step_control.py``)."""
        progress = batch.resume_from
        if progress is None:
            hidden = self.embed_tokens(batch.input_ids)  # [num_tokens, hidden_size]
            residual: torch.Tensor | None = None
            start = 0
        else:
            hidden, residual, start = progress.hidden, progress.residual, progress.next_layer
        for index in range(start, len(self.layers)):
            if batch.control.should_stop(index):
                return LayerProgress(index, hidden, residual)
            hidden, residual = self.layers[index](hidden, residual, batch, index)
        hidden, _ = self.norm(hidden, residual)
        return hidden  # [num_tokens, hidden_size]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [num_rows, vocab_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names) into this model; returns the names used
        (``load_deepseek_weights``). The multi-token-prediction layers
        (``model.layers.{num_hidden_layers + i}``) are not part of this model and are skipped; the
        ``mtp`` drafter loads them (``models/deepseek_mtp.py``)."""
        return load_deepseek_weights(self, (w for w in weights if not self.is_mtp_tensor(w[0])))

    def is_mtp_tensor(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to a multi-token-prediction layer."""
        parts = name.removeprefix("model.").split(".")
        return len(parts) > 2 and parts[0] == "layers" and int(parts[1]) >= self.args.num_layers


def load_deepseek_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy checkpoint tensors (names relative to ``module`` once a leading ``model.`` is dropped)
    into ``module``; returns the names used. Per-expert tensors are stacked into each layer's
    ``FusedExperts``; the dense MLPs' and shared experts' gate/up go into merged projections; a
    ``q_proj`` (no query LoRA) loads as itself. Unknown names and shape mismatches raise ValueError."""
    loaded: set[str] = set()
    rest = load_expert_tensors(module, _load_q_proj(module, weights, loaded), loaded)
    return loaded | load_hf_weights(module, rest)


def _load_q_proj(
    module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], loaded: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Load the ``self_attn.q_proj`` tensors (``load_hf_weights`` would merge them into a QKV
    projection this model does not have); yield the rest."""
    modules = dict(module.named_modules())
    for name, tensor in weights:
        module_path, _, param = name.removeprefix("model.").rpartition(".")
        if not module_path.endswith("self_attn.q_proj"):
            yield name, tensor
            continue
        target = modules.get(module_path)
        if not isinstance(target, ColumnParallelLinear) or tuple(tensor.shape) != _whole_shape(target):
            raise ValueError(f"checkpoint tensor {name} does not fit this model")
        target.load_weight(param, tensor)
        loaded.add(name)


def _whole_shape(layer: ColumnParallelLinear) -> tuple[int, int]:
    """The checkpoint's shape of ``layer``'s weight: every head (a rank keeps its own rows)."""
    return layer.weight.shape[0] * layer.tp.size, layer.weight.shape[1]
