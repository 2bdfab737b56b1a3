"""The block table of a drafter's own KV cache: a free list and per-request states, least recently
drafted first, shared by the proposers that run a head of their own (``worker/hidden_drafter.py``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class _HasBlocks(Protocol):
    block_table: list[int]


S = TypeVar("S", bound=_HasBlocks)


class DraftBlocks(Generic[S]):
    """Hands out ``num_blocks`` blocks of ``block_size`` slots to requests' states (made by
    ``new_state``). Contract: every block is either in ``free`` or in exactly one state's
    ``block_table``; ``drop`` gives a request's back."""

    def __init__(self, num_blocks: int, block_size: int, new_state: Callable[[], S]) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free = list(range(num_blocks))
        self.states: OrderedDict[str, S] = OrderedDict()  # least recently drafted first
        self._new_state = new_state

    def state(self, request_id: str) -> S:
        """The request's state (a new one when it has none); does not change the drafting order."""
        state = self.states.get(request_id)
        if state is None:
            state = self.states[request_id] = self._new_state()
        return state

    def drop(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            state = self.states.pop(request_id, None)
            if state is not None:
                self.free.extend(state.block_table)

    def prepare(self, request_id: str, num_slots: int, in_call: set[str]) -> S | None:
        """The request's state, made most recently drafted, with blocks for ``num_slots`` slots; other
        requests not in ``in_call`` give theirs back, least recently drafted first, when short. None
        (and the request's blocks given back) when the cache cannot hold it."""
        state = self.states.pop(request_id, None) or self._new_state()
        self.states[request_id] = state
        needed = -(-num_slots // self.block_size) - len(state.block_table)
        while needed > len(self.free):
            victim = next((r for r in self.states if r not in in_call), None)
            if victim is None:
                self.drop([request_id])
                return None
            self.drop([victim])
        if needed > 0:
            state.block_table.extend(self.free[-needed:])
            del self.free[-needed:]
        return state
