"""Qwen2-MoE and Qwen3-MoE: the Llama-family decoder with sparse mixture-of-experts feed-forwards.

Attention is Qwen2's (QKV biases) or Qwen3's (q/k RMSNorm), shared with ``llama.py``. A layer is
sparse when it is not in ``mlp_only_layers`` and ``(index + 1) % decoder_sparse_step == 0``; the
others keep a dense MLP of ``intermediate_size``. Routing is a softmax over every expert, then the
top ``num_experts_per_tok``, renormalised when ``norm_topk_prob``. Qwen2-MoE adds a shared expert
behind a sigmoid gate to every sparse layer.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.layers.fused_moe import SparseMoeBlock, load_expert_tensors, softmax_then_topk
from tokenmill.models.llama import LlamaArgs, LlamaForCausalLM, LlamaMLP


def is_sparse_layer(config, layer_index: int) -> bool:  # type: ignore[no-untyped-def]
    """Whether Qwen-MoE layer ``layer_index`` has experts (the rule transformers applies)."""
    mlp_only = getattr(config, "mlp_only_layers", None) or []
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer_index not in mlp_only and config.num_experts > 0 and (layer_index + 1) % step == 0


class QwenMoeForCausalLM(LlamaForCausalLM):
    """Qwen2MoeForCausalLM and Qwen3MoeForCausalLM over the paged KV cache."""

    def build_mlp(self, config, args: LlamaArgs, layer_index: int, dtype: torch.dtype) -> nn.Module:  # type: ignore[no-untyped-def]
        if not is_sparse_layer(config, layer_index):
            return LlamaMLP(args, dtype, tp=self.tp)
        shared_size = getattr(config, "shared_expert_intermediate_size", None)
        shared = LlamaMLP(args, dtype, intermediate_size=shared_size, tp=self.tp) if shared_size else None
        route = functools.partial(
            softmax_then_topk, top_k=config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob)
        )
        return SparseMoeBlock(
            args.hidden_size,
            config.num_experts,
            config.moe_intermediate_size,
            args.hidden_act,
            route,
            dtype,
            shared_expert=shared,
            tp=self.tp,
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As ``LlamaForCausalLM.load_weights``, with each expert's tensors stacked into its layer's
        ``FusedExperts`` and the shared expert's gate/up merged like any MLP's."""
        loaded: set[str] = set()
        rest = load_expert_tensors(self, weights, loaded)
        return loaded | super().load_weights(rest)
