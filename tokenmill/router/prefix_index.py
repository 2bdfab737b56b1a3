"""An approximate, per-replica index of which prompt prefixes each replica has cached.

A prompt is cut into chunks (``block_size`` token ids for data-parallel engines, the same blocks the
engine's radix tree caches; a few dozen characters of the request text for the HTTP router) and each
chunk is named by a hash chained over everything before it (``chunk_hashes``), so a hash stands for a
whole prefix, the namespace included. Each replica keeps the hashes of the prefixes it was sent in an
LRU bounded by its cache's size in chunks; ``match`` counts how many leading chunks of a prompt a
replica holds.

It is approximate on purpose: it learns from dispatches, not from the replicas' own cache events,
so it can believe a prefix is cached that the replica has evicted (or never cached, for a request
that was aborted early). That costs one recomputation on the replica the prefix sticks to, which
then caches it again; a policy reads it to keep same-prefix requests together, not as a promise.
Stale knowledge is dropped when a replica's cache is reset or its weights change (``clear``).
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
