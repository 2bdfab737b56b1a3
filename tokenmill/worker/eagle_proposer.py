"""The ``eagle`` / ``eagle3`` proposers: an EAGLE head (``models/eagle.py``) drafts from the target's
hidden states through ``worker/hidden_drafter.py`` (the same driver as ``mtp``).

``speculative_config["model"]`` is the head's folder. EAGLE-3 reads three target layers' inputs; the
fused CPU decoder stack does not expose them, so with ``eagle3`` the target runs layer by layer on
every step that records them (said in the log at start-up).

The head's linear layers take ``speculative_config["quantization"]`` (``head_quantization``: by
default int4 on CPU in bfloat16 where the kernel loads). A head's draft step reads all its weights for
a handful of rows, like a decode step of the target, so its time is their bytes: with SmolLM2-135M and
the head ``tokenmill train-eagle`` writes (one layer, a draft vocabulary of 8192: 18 MB in bfloat16,
5 MB in int4), a step that drafts for one sequence took ~1.1 ms in bfloat16 and ~0.7 ms in int4
(Zen 4), against ~4.7 ms for the target's decode step; acceptance was unchanged.
"""

from __future__ import annotations

import logging

import torch

from tokenmill.config import EngineConfig
from tokenmill.layers.cpu_kernels import load_error
from tokenmill.layers.quantization import quantize_modules
from tokenmill.models.base import CausalLM, prepare_for_inference
from tokenmill.models.eagle import EagleHead, eagle3_aux_layers, read_head_checkpoint
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.worker.hidden_drafter import HiddenStateProposer
from tokenmill.worker.kv_cache import allocate_kv_caches

logger = logging.getLogger(__name__)


class EagleProposer(HiddenStateProposer):
    """Drafts with an EAGLE-1 or EAGLE-3 head (see the module docstring)."""

    def __init__(
        self, config: EngineConfig, target: CausalLM, num_blocks: int, kv_dtype: torch.dtype
    ) -> None:
        spec = config.speculative_config
        assert spec is not None and spec.model is not None
        if not isinstance(target, LlamaForCausalLM):
            raise ValueError(
                f"speculative method {spec.method!r} needs a native Llama-family target; "
                f"{type(target).__name__} is not one"
            )
        head_config, tensors = read_head_checkpoint(spec.model)
        device = target.norm.weight.device  # (a quantized LM head has no float weight)
        dtype = target.norm.weight.dtype
        with torch.device(device):
            head = EagleHead(head_config, tensors, target, dtype)
        if head.layout != spec.method:
            raise ValueError(
                f"speculative method {spec.method!r} but {spec.model!r} holds an {head.layout} head "
                f"(EAGLE-1: method 'eagle'; EAGLE-3: method 'eagle3')"
            )
        kind = head_quantization(spec.quantization, device, dtype)
        quantized = quantize_modules(head, kind, dtype, device)
        # Pack the head's weights for the CPU matmul kernels, as the runner does the target's (the
        # target's embedding and LM head are not the head's modules): about half the time of a one-row
        # draft step against plain F.linear on bf16 weights.
        prepare_for_inference(head)
        self.head_module = head
        if head.eagle3:
            self.aux_layers = eagle3_aux_layers(head_config, target.args.num_layers)
            logger.warning(
                "eagle3 reads the inputs of target layers %s: the target runs layer by layer, "
                "not through the fused CPU decoder stack",
                list(self.aux_layers),
            )
        attention = head.layer.self_attn
        kv_cache = allocate_kv_caches(
            num_blocks,
            num_layers=1,
            block_size=config.cache.block_size,
            num_kv_heads=attention.num_kv_heads,
            head_dim=attention.head_dim,
            dtype=kv_dtype,
            device=device,
        )
        super().__init__(
            head, kv_cache, num_blocks, config.cache.block_size, spec.draft_confidence, device, dtype
        )
        draft_vocab = (
            "" if head.draft_to_target is None else f", draft vocabulary {head.draft_to_target.shape[0]}"
        )
        weights = f", {kind} weights in {quantized} layers" if quantized else ""
        logger.info("%s drafter: head from %s%s%s", spec.method, spec.model, draft_vocab, weights)


def head_quantization(kind: str | None, device: torch.device, dtype: torch.dtype) -> str:
    """The head's weight quantization: ``kind`` as given, or for None ``int4`` on CPU in bfloat16
    where the C++ kernels load, else ``none``."""
    if kind is not None:
        return kind
    if device.type == "cpu" and dtype == torch.bfloat16 and load_error() is None:
        return "int4"
    return "none"
