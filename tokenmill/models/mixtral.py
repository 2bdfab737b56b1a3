"""Mixtral: the Mistral decoder with a sparse mixture-of-experts feed-forward in every layer.

Attention (GQA, optional sliding window) is the Llama family's from ``llama.py``. Each token goes to
the ``num_experts_per_tok`` experts with the largest router logits, weighted by a softmax over those
logits. Checkpoints call the block ``block_sparse_moe`` and the expert projections ``w1`` (gate),
``w3`` (up) and ``w2`` (down).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tokenmill.layers.fused_moe import SparseMoeBlock, load_expert_tensors, topk_then_softmax
from tokenmill.models.llama import LlamaArgs, LlamaForCausalLM


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    # Our decoder layer calls its feed-forward `mlp` whatever it is.
    for name, tensor in weights:
        yield name.replace(".block_sparse_moe.", ".mlp."), tensor


class MixtralForCausalLM(LlamaForCausalLM):
    """MixtralForCausalLM over the paged KV cache."""

    def build_mlp(self, config, args: LlamaArgs, layer_index: int, dtype: torch.dtype) -> nn.Module:  # type: ignore[no-untyped-def]
        route = functools.partial(topk_then_softmax, top_k=config.num_experts_per_tok)
        return SparseMoeBlock(
            args.hidden_size,
            config.num_local_experts,
            args.intermediate_size,
            args.hidden_act,
            route,
            dtype,
            tp=self.tp,
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As ``LlamaForCausalLM.load_weights``, with ``w1``/``w3``/``w2`` of every expert stacked
        into its layer's ``FusedExperts``. Returned names use ``mlp`` for ``block_sparse_moe``."""
        loaded: set[str] = set()
        rest = load_expert_tensors(self, _renamed(weights), loaded)
        return loaded | super().load_weights(rest)
