"""The state pool: fixed-size slots for models that keep a recurrent state per sequence.

Linear-attention layers (Gated DeltaNet) and state-space layers keep a state of fixed size per
sequence instead of a growing KV cache. The worker holds, per such layer, tensors with one row per
slot (``worker/state_cache.py``); this pool hands out the slot ids. A running request holds one slot;
a prefix-cache snapshot (the state at a block boundary of some token prefix) holds another. Slots
are reference-counted like KV blocks, so a snapshot a request is about to copy from stays valid after
the tree drops it. Ints only, no torch.
"""

from __future__ import annotations

from tokenmill.core.kv.pool import BlockPool


class StatePool(BlockPool):
    """Slot ids with a free list and reference counts (``BlockPool``'s contract, for state slots).

    ``slot_bytes`` is what one slot takes across every recurrent layer, for memory reports.
    """

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        super().__init__(num_slots)
        self.slot_bytes = slot_bytes

    @property
    def num_slots(self) -> int:
        return self.num_blocks
