"""The state pool's tensors: per recurrent layer, one row per slot of each of its state tensors.

The model declares the layout (``recurrent_state_layout()``: per layer, each tensor's per-slot shape
and dtype); the core's ``StatePool`` hands out the slot ids. Before a step the runner prepares each
sequence's slot: zeroed when the sequence starts at position 0, a snapshot copied in when it resumes
from one (``ScheduledRequest.state_source``).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch

from tokenmill.core.step_io import ScheduledRequest
from tokenmill.layers.recurrent_state import RecurrentBatch, RecurrentSequence

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.models.base import CausalLM

logger = logging.getLogger(__name__)

StateLayout = list[list[tuple[tuple[int, ...], torch.dtype]]]


def slot_bytes(layout: StateLayout) -> int:
    """Bytes one slot takes across every layer."""
    return sum(
        math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        for layer in layout
        for shape, dtype in layer
    )


class StateCache:
    """The recurrent layers' state tensors for ``num_slots`` slots."""

    def __init__(self, layout: StateLayout, num_slots: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes(layout)
        self.caches = [
            [torch.zeros((num_slots, *shape), dtype=dtype, device=device) for shape, dtype in layer]
            for layer in layout
        ]

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def prepare(
        self, entries: list[ScheduledRequest], offsets: list[int], device: torch.device
    ) -> RecurrentBatch:
        """Zero or fill each entry's slot as its plan says and describe the step for the layers."""
        sequences = []
        for entry, offset in zip(entries, offsets):
            if entry.state_slot < 0:
                raise ValueError(f"request {entry.request_id} has no recurrent-state slot")
            if entry.state_source >= 0:
                self._copy(entry.state_source, entry.state_slot)
            elif entry.start_position == 0:
                for layer in self.caches:
                    for tensor in layer:
                        tensor[entry.state_slot].zero_()
            checkpoints = [
                (position - entry.start_position, slot) for position, slot in entry.state_checkpoints
            ]
            sequences.append(RecurrentSequence(offset, len(entry.token_ids), entry.state_slot, checkpoints))
        return RecurrentBatch.build(self.caches, sequences, device)

    def _copy(self, source: int, target: int) -> None:
        for layer in self.caches:
            for tensor in layer:
                tensor[target].copy_(tensor[source])


def make_state_cache(model: CausalLM, config: EngineConfig, device: torch.device) -> StateCache | None:
    """The state pool's tensors for a model with recurrent layers (None for others): ``num_state_slots``
    slots, by default two per ``max_num_seqs``. Refuses the features that cannot keep such state
    right yet (ValueError)."""
    layout = getattr(model, "recurrent_state_layout", None)
    if layout is None:
        return None
    for enabled, feature in (
        (config.speculative_config is not None, "speculative decoding"),
        (config.deterministic, "the deterministic mode"),
        (config.lora.enable_lora, "LoRA"),
    ):
        if enabled:
            raise ValueError(f"{feature} with recurrent-state models is not supported yet")
    num_slots = config.cache.num_state_slots or 2 * config.scheduler.max_num_seqs
    cache = StateCache(layout(), num_slots, device)
    logger.info(
        "recurrent state: %d slots of %.2f MB (%.2f GB)",
        num_slots,
        cache.slot_bytes / 1e6,
        cache.total_bytes / 1e9,
    )
    return cache
