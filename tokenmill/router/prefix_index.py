"""An approximate, per-replica index of which prompt prefixes each replica has cached.

A prompt is cut into chunks (``block_size`` token ids for data-parallel engines, the same blocks the
engine's radix tree caches; a few dozen characters of the request text for the HTTP router) and each
chunk is named by a hash chained over everything before it (``chunk_hashes``), so a hash stands for a
whole prefix, the namespace included. Each replica keeps the hashes of the prefixes it was sent in an
LRU bounded by its cache's size in chunks; ``match`` counts how many leading chunks of a prompt a
replica holds.

``ReplicaPrefixes`` (the HTTP router's) is approximate on purpose: it learns from dispatches,
so it can believe a prefix is cached that the replica has evicted (or never cached, for a request
that was aborted early). That costs one recomputation on the replica the prefix sticks to, which
then caches it again; a policy reads it to keep same-prefix requests together, not as a promise.
Stale knowledge is dropped when a replica's cache is reset or its weights change (``clear``).
``EventFedPrefixes`` (a data-parallel server's) learns from the engines' own cache events instead
(``core/kv/kv_events.py``), so it follows evictions.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence


def chunk_hashes(namespace: Hashable, units: Sequence[object], chunk_size: int) -> list[int]:
    """The chained hashes of the full ``chunk_size`` chunks of ``units`` (a partial last chunk is not
    hashed: an engine caches whole blocks only). Entry ``i`` stands for ``units[: (i + 1) *
    chunk_size]`` under ``namespace``; equal prefixes under equal namespaces give equal entries."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    hashes: list[int] = []
    previous = hash(("tokenmill-prefix", namespace))
    for start in range(0, len(units) - chunk_size + 1, chunk_size):
        previous = hash((previous, tuple(units[start : start + chunk_size])))
        hashes.append(previous)
    return hashes


class ReplicaPrefixes:
    """One replica's cached prefixes: an LRU set of chunk hashes holding at most ``capacity``.

    ``insert`` touches the deepest chunk first and the shortest prefix last, so the LRU end holds
    the deepest chunks: eviction drops a prompt's tail before its head, as the engine's radix tree
    evicts leaves before their parents.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 chunk, got {capacity}")
        self.capacity = capacity
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading entries of ``hashes`` this replica holds."""
        matched = 0
        for value in hashes:
            if value not in self._lru:
                break
            matched += 1
        return matched

    def insert(self, hashes: Sequence[int]) -> None:
        """Record that the replica now caches every prefix in ``hashes``; evict the least recently
        used chunks beyond ``capacity``."""
        for value in reversed(hashes):
            self._lru[value] = None
            self._lru.move_to_end(value)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)

    def clear(self) -> None:
        self._lru.clear()


class EventFedPrefixes:
    """One replica's cached prefixes as its own cache reports them (``core/kv/kv_events.py``), plus
    the guesses of dispatches not yet answered.

    ``apply`` takes the replica's ``stored`` / ``removed`` / ``cleared`` events, in order; a block
    hash is held while more ``stored`` than ``removed`` events named it (two engine namespaces, an
    adapter and its reload, may give one hash). ``insert`` (a dispatch) records the prompt's hashes
    as *pending*: counted by ``match`` so that a burst of same-prefix requests sticks together
    before the first of them is computed, until ``settle`` (the request's first output, by which
    the replica has reported what it cached, or its end) drops them. ``capacity`` is the replica's
    cache size in blocks; pending guesses beyond it are dropped oldest first.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 chunk, got {capacity}")
        self.capacity = capacity
        self.held: dict[int, int] = {}
        self._pending: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self.held) + sum(1 for value in self._pending if value not in self.held)

    def match(self, hashes: Sequence[int]) -> int:
        matched = 0
        for value in hashes:
            if value not in self.held and value not in self._pending:
                break
            matched += 1
        return matched

    def insert(self, hashes: Sequence[int]) -> None:
        """A dispatch: the replica will cache ``hashes`` (pending until ``settle``)."""
        for value in hashes:
            self._pending[value] = self._pending.get(value, 0) + 1
            self._pending.move_to_end(value)
        while len(self._pending) > self.capacity:
            self._pending.popitem(last=False)

    def settle(self, hashes: Sequence[int]) -> None:
        """The dispatch of ``hashes`` was answered: its guesses give way to the replica's events."""
        for value in hashes:
            count = self._pending.get(value)
            if count is None:
                continue
            if count <= 1:
                del self._pending[value]
            else:
                self._pending[value] = count - 1

    def apply(self, kind: str, hashes: Sequence[int]) -> None:
        """One cache event of the replica (see the class docstring)."""
        if kind == "cleared":
            self.held.clear()
        elif kind == "stored":
            for value in hashes:
                self.held[value] = self.held.get(value, 0) + 1
        elif kind == "removed":
            for value in hashes:
                count = self.held.get(value, 0)
                if count <= 1:
                    self.held.pop(value, None)
                else:
                    self.held[value] = count - 1
        else:
            raise ValueError(f"unknown KV cache event {kind!r}")

    def clear(self) -> None:
        self.held.clear()
        self._pending.clear()
