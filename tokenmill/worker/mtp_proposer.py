"""The ``mtp`` proposer: DeepSeek-V3's multi-token-prediction layer drafts from the target's hidden states.

The MTP layer (``models/deepseek_mtp.py``) at position ``p`` needs the target's final hidden state at
``p`` and the token at ``p + 1``; ``worker/hidden_drafter.py`` records those, catches the layer up and
chains it on its own output (shared with the EAGLE heads). The layer's KV cache is a one-layer latent
cache of its own with the target's block count.
"""

from __future__ import annotations

import logging

import torch

from tokenmill.config import EngineConfig
from tokenmill.layers.attention.backend import AttentionBackend
from tokenmill.layers.attention.torch_ref import TorchReferenceBackend
from tokenmill.layers.forward_batch import ForwardBatch
from tokenmill.loader import ModelSource
from tokenmill.models.base import CausalLM
from tokenmill.models.deepseek_mtp import DeepseekV3MTPLayer
from tokenmill.models.deepseek_v3 import DeepseekV3ForCausalLM
from tokenmill.worker.hidden_drafter import HiddenStateProposer
from tokenmill.worker.kv_cache import allocate_kv_caches

logger = logging.getLogger(__name__)


class _MTPHead:
    """The MTP layer as a ``DraftHead``: same vocabulary, the target's final hidden state as features."""

    draft_to_target: torch.Tensor | None = None
    attention_backend: type[AttentionBackend] = TorchReferenceBackend

    def __init__(self, layer: DeepseekV3MTPLayer) -> None:
        self.layer = layer
        self.feature_size = layer.eh_proj.in_features // 2

    def forward(
        self, previous: torch.Tensor, next_token_ids: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        return self.layer(previous, next_token_ids, batch)  # [num_tokens, hidden_size]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer.compute_logits(hidden)  # [rows, vocab_size]


class MTPProposer(HiddenStateProposer):
    """Drafts with the checkpoint's first MTP layer (see the module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        target: CausalLM,
        num_blocks: int,
        kv_dtype: torch.dtype,
    ) -> None:
        if not isinstance(target, DeepseekV3ForCausalLM):
            raise ValueError(
                f"speculative method 'mtp' needs a native model with multi-token-prediction layers "
                f"(DeepSeek-V3, Kimi K2); {type(target).__name__} has none"
            )
        if target.args.num_nextn_predict_layers < 1:
            raise ValueError("speculative method 'mtp': this checkpoint has no multi-token-prediction layer")
        spec = config.speculative_config
        assert spec is not None
        device = target.lm_head.weight.device
        dtype = target.lm_head.weight.dtype
        with torch.device(device):
            self.layer = DeepseekV3MTPLayer(source.hf_config, target, 0, dtype)
        self.layer.to(dtype)
        self.layer.load_weights(source.iter_weights(only=target.is_mtp_tensor))  # reads no other tensor
        self.layer.eval()
        spec_of_cache = target.kv_cache_spec
        kv_cache = allocate_kv_caches(
            num_blocks,
            num_layers=1,
            block_size=config.cache.block_size,
            num_kv_heads=spec_of_cache.num_kv_heads,
            head_dim=spec_of_cache.head_dim,
            dtype=kv_dtype,
            device=device,
            num_planes=spec_of_cache.num_planes,
        )
        super().__init__(
            _MTPHead(self.layer),
            kv_cache,
            num_blocks,
            config.cache.block_size,
            spec.draft_confidence,
            device,
            self.layer.eh_proj.weight.dtype,
        )
        logger.info(
            "mtp drafter: multi-token-prediction layer %d of the checkpoint", self.layer.checkpoint_layer
        )
