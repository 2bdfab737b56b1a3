"""PEFT adapters for the LoRA tests: random weights (non-zero ``lora_B``) saved with
``save_pretrained``, and the reference model each gives after ``merge_and_unload``."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

UNK = 0


@dataclass
class Adapter:
    """A saved adapter folder and the merged transformers model that is its reference."""

    name: str
    path: str
    merged: Any
    _greedy: dict[tuple[tuple[int, ...], int], list[int]] = field(default_factory=dict)

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in self._greedy:
            ids = torch.tensor([prompt])
            out = self.merged.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=UNK,
            )
            self._greedy[key] = out[0, len(prompt) :].tolist()
        return list(self._greedy[key])

    def log_softmax(self, token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = self.merged(torch.tensor([token_ids])).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)


def make_adapter(
    hf_model: Any,
    folder: str,
    name: str,
    seed: int,
    rank: int = 8,
    alpha: float = 16.0,
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    use_rslora: bool = False,
    scale: float = 0.5,
) -> Adapter:
    """A PEFT LoRA adapter on (a copy of) ``hf_model`` with random A and B (B non-zero, scaled by
    ``scale`` so the adapter changes greedy outputs without drowning the base), saved in ``folder``."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        use_rslora=use_rslora,
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    model = get_peft_model(copy.deepcopy(hf_model), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_" in param_name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale / param.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    merged = model.merge_and_unload().eval()
    return Adapter(name=name, path=folder, merged=merged)
