"""The model runner's side of LoRA: wrapped layers, a CPU cache of adapters and the device slots.

``LoRAManager(model, ...)`` wraps every adaptable projection of a native model (``qkv_proj``,
``o_proj``, ``gate_up_proj``, ``down_proj`` of each layer) in a ``LoRALinear`` with ``max_loras``
slots of rank up to ``max_lora_rank``. Adapters are known by an integer id the engine core assigns
per load (``core/lora_slots.py``); ``add`` reads and checks one (``lora/adapter.py``) and keeps it
in an LRU cache of at most ``max_cpu_loras`` (an evicted one is read again from its folder when a
slot needs it); ``load_slot`` copies one into a slot of every wrapped layer. The engine core decides
which adapter goes in which slot and never plans a step whose adapters are not all in slots.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch
from torch import nn

from tokenmill.layers import lora_kernel
from tokenmill.layers.linear import LinearBase
from tokenmill.layers.lora import LoRABatch, LoRALinear, LoRAStepState
from tokenmill.lora.adapter import LoRAAdapter, load_adapter

logger = logging.getLogger(__name__)

ADAPTED_LEAVES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def wrap_projections(
    model: nn.Module, state: LoRAStepState, max_loras: int, max_rank: int, dtype: torch.dtype = torch.float32
) -> dict[str, LoRALinear]:
    """Replace each adaptable projection of ``model`` by a ``LoRALinear`` around it; returns them by
    module path. Slots are bfloat16 for a bfloat16 model where the CPU kernel has that path, else
    float32 (``lora_kernel.slot_dtype``). The fused CPU decoder stack, which calls the projections'
    weights from C++, is turned off (``decode_stack``): it would leave the deltas out."""
    wrapped: dict[str, LoRALinear] = {}
    for name, module in list(model.named_modules()):
        parent_name, _, leaf = name.rpartition(".")
        if leaf in ADAPTED_LEAVES and isinstance(module, LinearBase):
            parent = model.get_submodule(parent_name)
            slot_dtype = lora_kernel.slot_dtype(dtype, module.weight.device)
            layer = LoRALinear(module, state, max_loras, max_rank, slot_dtype)
            setattr(parent, leaf, layer)
            wrapped[name] = layer
    if not wrapped:
        raise ValueError(f"{type(model).__name__} has no projections LoRA can adapt")
    if getattr(model, "decode_stack", None) is not None:
        model.decode_stack = None  # type: ignore[assignment]
    return wrapped


class LoRAManager:
    """Adapters on CPU (LRU) and in device slots, for one model (see the module docstring)."""

    def __init__(
        self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int, dtype: torch.dtype
    ) -> None:
        self.state = LoRAStepState()
        self.layers = wrap_projections(model, self.state, max_loras, max_lora_rank, dtype)
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.paths: dict[int, str] = {}  # every adapter added and not removed
        self.cpu_cache: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.slot_adapters: list[int | None] = [None] * max_loras
        self.num_slot_loads = 0
        self.load_seconds_total = 0.0

    def add(self, lora_id: int, path: str) -> int:
        """Read and check the adapter at ``path`` as ``lora_id`` (ValueError if it does not fit the
        model); returns its rank."""
        adapter = load_adapter(path, self.layers, self.max_lora_rank)
        self.paths[lora_id] = path
        self._cache(lora_id, adapter)
        return adapter.rank

    def remove(self, lora_id: int) -> None:
        """Forget ``lora_id`` (the engine core no longer plans it); its slot becomes free."""
        self.paths.pop(lora_id, None)
        self.cpu_cache.pop(lora_id, None)
        for slot, held in enumerate(self.slot_adapters):
            if held == lora_id:
                self.slot_adapters[slot] = None
                for layer in self.layers.values():
                    layer.set_slot(slot, 0, None, None)

    def load_slot(self, slot: int, lora_id: int) -> float:
        """Put adapter ``lora_id`` in device slot ``slot`` of every wrapped layer (layers it leaves
        alone get rank 0); returns the seconds it took (0 when it was already there)."""
        if self.slot_adapters[slot] == lora_id:
            return 0.0
        if lora_id not in self.paths:
            raise ValueError(f"LoRA adapter id {lora_id} was never added")
        started = time.perf_counter()
        adapter = self.cpu_cache.get(lora_id)
        if adapter is None:  # evicted from the CPU cache: read again
            adapter = load_adapter(self.paths[lora_id], self.layers, self.max_lora_rank)
            self._cache(lora_id, adapter)
        self.cpu_cache.move_to_end(lora_id)
        for name, layer in self.layers.items():
            delta = adapter.layers.get(name)
            if delta is None:
                layer.set_slot(slot, 0, None, None)
            else:
                layer.set_slot(slot, delta.rank, delta.a, delta.bt)
        self.slot_adapters[slot] = lora_id
        seconds = time.perf_counter() - started
        self.num_slot_loads += 1
        self.load_seconds_total += seconds
        return seconds

    def batch_for(self, slots_and_counts: list[tuple[int, int]], device: torch.device) -> LoRABatch | None:
        """The step's row-to-slot map (``LoRABatch.build``); every slot named must hold an adapter."""
        for slot, _ in slots_and_counts:
            if slot >= 0 and self.slot_adapters[slot] is None:
                raise RuntimeError(f"a step uses LoRA slot {slot}, which holds no adapter")
        return LoRABatch.build(slots_and_counts, device)

    def _cache(self, lora_id: int, adapter: LoRAAdapter) -> None:
        self.cpu_cache[lora_id] = adapter
        self.cpu_cache.move_to_end(lora_id)
        while len(self.cpu_cache) > self.max_cpu_loras:
            evicted, _ = self.cpu_cache.popitem(last=False)
            logger.debug("LoRA adapter %d leaves the CPU cache", evicted)
