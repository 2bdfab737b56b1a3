"""Copying Hugging Face checkpoint tensors into native models built from the shared layers."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.layers.linear import MergedColumnLinear

# Separate checkpoint projections that our models merge: checkpoint leaf -> (module, shard).
MERGED_PROJECTIONS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def load_hf_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy checkpoint tensors (Hugging Face names) into ``model``; returns the names used.

    Names are looked up under ``model``'s module tree with any leading ``model.`` removed. Separate
    q/k/v and gate/up checkpoint tensors go into the merged projections, fused ones (Phi-3) too.
    Unknown names and shape mismatches raise ValueError, so a checkpoint that does not match the
    architecture never loads silently.
    """
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue
        key = name.removeprefix("model.")
        module_path, _, param = key.rpartition(".")
        parent, _, leaf = module_path.rpartition(".")
        if leaf in ("qkv_proj", "gate_up_proj"):  # Phi-3 stores the merged projections fused
            module = modules.get(module_path)
            if not isinstance(module, MergedColumnLinear):
                raise ValueError(f"checkpoint tensor {name} has no place in this model")
            module.load_fused(param, tensor)
        elif leaf in MERGED_PROJECTIONS:
            target, shard = MERGED_PROJECTIONS[leaf]
            module = modules.get(f"{parent}.{target}")
            if not isinstance(module, MergedColumnLinear):
                raise ValueError(f"checkpoint tensor {name} has no place in this model")
            module.load_shard(shard, param, tensor)
        else:
            module = modules.get(module_path)
            if module is None:
                raise ValueError(f"checkpoint tensor {name} has no place in this model")
            if hasattr(module, "load_weight"):
                module.load_weight(param, tensor)
            else:
                param_tensor = getattr(module, param, None)
                if not isinstance(param_tensor, torch.Tensor) or param_tensor.shape != tensor.shape:
                    raise ValueError(f"checkpoint tensor {name} does not fit this model")
                param_tensor.data.copy_(tensor)
        loaded.add(name)
    return loaded
