"""The model interface the model runner drives, shared by native models and the transformers fallback.

A model answers what sizes its KV cache (``num_layers``, ``num_kv_heads``, ``head_dim``, gathered
in ``kv_cache_spec``, which a model with another cache layout overrides) and which
attention windows its layers use (``sliding_window``, ``layer_sliding_windows``), and computes a
step's logits with ``forward_logits``. A native model writes ``forward(batch)`` (every token's final
hidden state, or the ``LayerProgress`` where ``batch.control`` stopped the pass) and
``compute_logits(hidden)`` (its head over the rows asked for); the default ``forward_logits`` chains
them. The transformers fallback overrides ``forward_logits`` (its model's own head must run inside
its forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.layers.forward_batch import ForwardBatch
from tokenmill.step_control import LayerProgress


def prepare_for_inference(model: nn.Module) -> None:
    """Run every module's ``prepare_for_inference`` (packed weights, derived tensors, fused stacks),
    children first: a parent collects what its children prepared (a model's fused stack reads its
    layers' packed weights)."""
    for module in reversed(list(model.modules())):
        prepare = getattr(module, "prepare_for_inference", None)
        if prepare is not None:
            prepare()


@dataclass(frozen=True)
class KVCacheSpec:
    """The per-layer paged cache a model attends over: ``[num_planes, num_blocks, block_size,
    num_kv_heads, head_dim]``. ``num_planes`` is 2 for separate keys and values, 1 for a single
    tensor that holds both (multi-head latent attention's compressed latent plus its rotary key, one
    "head" per token)."""

    num_kv_heads: int
    head_dim: int
    num_planes: int = 2


class CausalLM(nn.Module):
    """A causal LM over tokenmill's paged KV cache (see the module docstring for the contract)."""

    @property
    def num_layers(self) -> int:
        raise NotImplementedError

    @property
    def num_kv_heads(self) -> int:
        raise NotImplementedError

    @property
    def head_dim(self) -> int:
        raise NotImplementedError

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """The layout of each layer's KV cache; by default keys and values of ``num_kv_heads`` heads."""
        return KVCacheSpec(self.num_kv_heads, self.head_dim)

    @property
    def sliding_window(self) -> int | None:
        """The attention window every layer uses (None: full attention, or layers that differ)."""
        return None

    @property
    def layer_sliding_windows(self) -> list[int | None]:
        """Each layer's attention window; the backend builds one metadata per distinct entry."""
        return [self.sliding_window] * self.num_layers

    # Whether the sliding-window layers may keep their KV in a second group with its own pool and
    # block table, freed behind the window as decoding proceeds (worker/kv_groups.py); the model's
    # layers must read their metadata through ``batch.attention(window)``.
    window_kv_group: bool = False

    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor | LayerProgress:
        """Logits ``[num_logit_rows, vocab_size]`` for ``batch.logits_rows`` (float32 or the activation
        dtype), or the ``LayerProgress`` where ``batch.control`` stopped the pass (nothing projected)."""
        hidden = self(batch)  # [num_tokens, hidden_size] or LayerProgress
        if isinstance(hidden, LayerProgress):
            return hidden
        return self.compute_logits(hidden[batch.logits_rows])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head over ``hidden`` ``[num_rows, hidden_size]``: ``[num_rows, vocab_size]``."""
        raise NotImplementedError(f"{type(self).__name__} computes logits in forward_logits")
