"""The state pool's tensors: per recurrent layer, one row per slot of each of its state tensors.

The model declares the layout (``recurrent_state_layout()``: per layer, each tensor's per-slot shape
and dtype); the core's ``StatePool`` hands out the slot ids. Before a step the runner prepares each
sequence's slot: zeroed when the sequence starts at position 0, a snapshot copied in when it resumes
from one (``ScheduledRequest.state_source``).
"""

from __future__ import annotations

import math

import torch

from tokenmill.core.step_io import ScheduledRequest
from tokenmill.layers.recurrent_state import RecurrentBatch, RecurrentSequence

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
