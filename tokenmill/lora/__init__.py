"""Multi-LoRA serving: PEFT adapters read and checked (``adapter.py``), kept on CPU and in device
slots by the model runner (``manager.py``); the requests' handle is ``LoRARequest``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """Generate with the PEFT adapter in folder ``lora_path``, known as ``lora_name`` (vLLM's shape;
    ``lora_int_id`` is the caller's id for it, kept for compatibility)."""

    lora_name: str
    lora_int_id: int
    lora_path: str


__all__ = ["LoRARequest"]
