"""DeepSeek-V3's multi-token-prediction (MTP) layer: the checkpoint's drafter, no extra model needed.

The checkpoint stores it as ``model.layers.{num_hidden_layers + i}``: ``enorm`` and ``hnorm`` (RMS
norms of the next token's embedding and of the main model's hidden state), ``eh_proj`` (their
concatenation, embedding first, back to the hidden size), one ordinary DeepSeek-V3 decoder layer
(MLA and an MoE feed-forward, with its own KV cache) and ``shared_head.norm``; the embedding and the
output head are the main model's (the checkpoint's copies, ``embed_tokens`` and
``shared_head.head``, are the same tensors and are not loaded twice).

At position ``p`` the layer reads the main model's final hidden state of position ``p`` and the
token at ``p + 1``, and its logits predict the token at ``p + 2``: one step beyond what the main
model's own head predicts. ``worker/mtp_proposer.py`` drives it as the ``mtp`` speculative method.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.layers.embedding import LMHead, VocabEmbedding
from tokenmill.layers.forward_batch import ForwardBatch
from tokenmill.layers.linear import ColumnParallelLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.models.deepseek_v3 import (
    DeepseekV3Args,
    DeepseekV3DecoderLayer,
    DeepseekV3ForCausalLM,
    load_deepseek_weights,
)

# The MTP layer's own parts; every other tensor of the layer belongs to its decoder block.
_OWN_PARTS = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
# The checkpoint's copies of the main model's embedding and head.
_SHARED_COPIES = ("embed_tokens.", "shared_head.head.")


class SharedHead(nn.Module):
    """``shared_head.norm`` (the checkpoint's name); the head itself is the main model's."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)


class DeepseekV3MTPLayer(nn.Module):
    """One multi-token-prediction layer over its own one-layer latent KV cache."""

    def __init__(self, config, target: DeepseekV3ForCausalLM, index: int, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        args: DeepseekV3Args = target.args
        self.index = index
        self.checkpoint_layer = args.num_layers + index
        self.enorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.hnorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.eh_proj = ColumnParallelLinear(2 * args.hidden_size, args.hidden_size, dtype=dtype)
        # Its feed-forward is sparse like the main model's deep layers (index past the dense ones).
        self.block = DeepseekV3DecoderLayer(config, args, target.rotary, self.checkpoint_layer, dtype)
        self.shared_head = SharedHead(args.hidden_size, args.rms_norm_eps)
        # The main model's, not registered here (no second copy, no second load).
        self._embed: tuple[VocabEmbedding, LMHead] = (target.embed_tokens, target.lm_head)

    def forward(
        self, previous_hidden: torch.Tensor, next_token_ids: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """The layer's hidden state ``[num_tokens, hidden_size]`` at ``batch.positions``, from the
        previous hidden state at each position (the main model's final one, or this layer's own when
        chaining drafts) and the token after it; the layer's KV is ``batch.kv_caches[0]``."""
        embedding = self._embed[0](next_token_ids)  # [num_tokens, hidden_size]
        joined = torch.cat([self.enorm(embedding), self.hnorm(previous_hidden)], dim=-1)  # [T, 2 * hidden]
        hidden, residual = self.block(self.eh_proj(joined), None, batch, 0)
        return hidden + residual  # [num_tokens, hidden_size]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The shared head over this layer's hidden states: ``[num_rows, vocab_size]``."""
        return self._embed[1](self.shared_head.norm(hidden))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the checkpoint tensors of ``model.layers.{checkpoint_layer}.*`` (others are ignored);
        returns the names used. Raises ValueError when the layer is missing or incomplete."""
        prefix = f"model.layers.{self.checkpoint_layer}."
        renamed: dict[str, str] = {}

        def own(items: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in items:
                if not name.startswith(prefix):
                    continue
                rest = name.removeprefix(prefix)
                if rest.startswith(_SHARED_COPIES):
                    continue
                local = rest if rest.startswith(_OWN_PARTS) else f"block.{rest}"
                renamed[local] = name
                yield local, tensor

        loaded = load_deepseek_weights(self, own(weights))
        expected = {name for name, _ in self.named_parameters()}
        missing = sorted(expected - {_parameter_of(n) for n in loaded} - _stacked_expert_names(self))
        if not loaded or missing:
            raise ValueError(
                f"the checkpoint's multi-token-prediction layer {self.checkpoint_layer} is missing or "
                f"incomplete (missing {missing[:4] or 'every tensor'})"
            )
        return {renamed.get(n, n) for n in loaded}


def _parameter_of(name: str) -> str:
    """Our parameter for a loaded checkpoint name (separate gate/up land in the merged projection)."""
    for leaf, merged in (("gate_proj", "gate_up_proj"), ("up_proj", "gate_up_proj")):
        name = name.replace(f".{leaf}.", f".{merged}.")
    return name


def _stacked_expert_names(layer: nn.Module) -> set[str]:
    """The stacked expert parameters, loaded one expert at a time under other names."""
    return {name for name, _ in layer.named_parameters() if ".experts.w" in name}
