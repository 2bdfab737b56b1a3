"""The model runner's speculative drafter (``spec/``), chosen by ``SpeculativeConfig.method``: a
draft model, the checkpoint's multi-token-prediction layer, an EAGLE head (each with a KV cache of
``num_blocks`` blocks beside the target's), or a model-free proposer (``spec.proposer.make_proposer``).
"""

from __future__ import annotations

import torch

from tokenmill.config import EngineConfig
from tokenmill.loader import ModelSource
from tokenmill.models.base import CausalLM
from tokenmill.spec.proposer import Proposer, make_proposer


def make_drafter(
    config: EngineConfig, source: ModelSource, target: CausalLM, num_blocks: int, kv_dtype: torch.dtype
) -> Proposer | None:
    """The drafter the runner calls after each step's sampling; None when speculative decoding is
    off. The model-based drafters are imported only when chosen (they load weights)."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "draft_model":
        from tokenmill.worker.draft_model import DraftModelProposer

        return DraftModelProposer(config, int(source.hf_config.vocab_size), num_blocks)
    if spec.method == "mtp":
        from tokenmill.worker.mtp_proposer import MTPProposer

        return MTPProposer(config, source, target, num_blocks, kv_dtype)
    if spec.method in ("eagle", "eagle3"):
        from tokenmill.worker.eagle_proposer import EagleProposer

        return EagleProposer(config, target, num_blocks, kv_dtype)
    return make_proposer(spec)
