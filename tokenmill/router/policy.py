"""Dispatch policies: which replica (an engine of a data-parallel server, or a worker server behind
the HTTP router) serves the next request.

- ``round_robin``: the next replica in turn.
- ``least_load``: the replica with the fewest requests in flight (ties: the next in turn).
- ``cache_aware`` (default): the replica holding the longest prefix of the prompt in its
  ``ReplicaPrefixes`` index, unless the loads are imbalanced, i.e. the busiest and the idlest replica
  differ by more than ``balance_abs`` requests *and* the busiest has more than ``balance_rel`` times
  the idlest's load: then the least loaded one. Ties on the prefix go to the least loaded of them,
  then to the one whose index holds least, then in turn. A prompt no replica holds any of goes to
  the replica whose index holds least (its cache has the most room for a new prefix), then the
  least loaded, then in turn: new prefixes spread evenly over the caches.

Loads are the caller's count of requests it sent to a replica and that have not ended; the caller
reports each dispatch (``on_dispatch``) and each end (``on_finish``). Replicas are named by strings
(a data-parallel rank, a worker's URL) and may join and leave (``add_replica``, ``remove_replica``).
Pure Python, no I/O, nothing of tokenmill but the policy names in ``config.py``: the same object
serves ``core/dp_client.py`` and ``router/app.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from tokenmill.config import DP_POLICIES
from tokenmill.router.prefix_index import EventFedPrefixes, ReplicaPrefixes, chunk_hashes

__all__ = ["DP_POLICIES", "Decision", "DispatchPolicy", "PromptKey"]
DEFAULT_BALANCE_ABS = 8
DEFAULT_BALANCE_REL = 1.5


@dataclass(frozen=True)
class Decision:
    """Where one request goes: the ``replica``, the chunks of its prompt the index believes that
    replica holds (``matched_chunks``), and why (``prefix``, ``new_prefix``, ``balance``,
    ``least_load``, ``round_robin``)."""

    replica: str
    matched_chunks: int
    reason: str


@dataclass(frozen=True)
class PromptKey:
    """A prompt as the policy sees it: the chained hashes of its chunks (``chunk_hashes``)."""

    hashes: list[int]

    @classmethod
    def of(cls, namespace: Hashable, units: Sequence[object], chunk_size: int) -> PromptKey:
        return cls(chunk_hashes(namespace, units, chunk_size))


class DispatchPolicy:
    """Chooses replicas and keeps the loads (and, for ``cache_aware``, the prefix index).

    ``capacity_chunks`` bounds each replica's index (its cache's size in chunks). Raises ValueError
    for an unknown policy or bad thresholds, and from ``choose`` when no replica is available.
    """

    def __init__(
        self,
        name: str = "cache_aware",
        *,
        balance_abs: int = DEFAULT_BALANCE_ABS,
        balance_rel: float = DEFAULT_BALANCE_REL,
    ) -> None:
        if name not in DP_POLICIES:
            raise ValueError(f"dispatch policy must be one of {', '.join(DP_POLICIES)}, got {name!r}")
        if balance_abs < 0:
            raise ValueError(f"balance_abs must be >= 0, got {balance_abs}")
        if balance_rel < 1.0:
            raise ValueError(f"balance_rel must be >= 1.0, got {balance_rel}")
        self.name = name
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.loads: dict[str, int] = {}
        self.prefixes: dict[str, ReplicaPrefixes | EventFedPrefixes] = {}
        self._turn = itertools.count()

    # ------------------------------------------------------------------ membership

    @property
    def replicas(self) -> list[str]:
        return list(self.loads)

    def add_replica(
        self, replica: str, capacity_chunks: int, index: ReplicaPrefixes | EventFedPrefixes | None = None
    ) -> None:
        """Start dispatching to ``replica`` (with ``index``, by default an empty dispatch-fed
        ``ReplicaPrefixes``; a replica already known keeps its load and index)."""
        if replica in self.loads:
            return
        self.loads[replica] = 0
        self.prefixes[replica] = index if index is not None else ReplicaPrefixes(capacity_chunks)

    def remove_replica(self, replica: str) -> None:
        """Stop dispatching to ``replica`` and forget its load and index; unknown names are ignored."""
        self.loads.pop(replica, None)
        self.prefixes.pop(replica, None)

    def clear_prefixes(self, replica: str | None = None) -> None:
        """Forget what ``replica`` (every replica when None) caches: its cache was reset or its
        weights changed."""
        for name, index in self.prefixes.items():
            if replica is None or name == replica:
                index.clear()

    # ------------------------------------------------------------------ dispatch

    def choose(self, key: PromptKey, available: Sequence[str] | None = None) -> Decision:
        """The replica for a prompt, among ``available`` (default: every replica)."""
        candidates = [r for r in (self.replicas if available is None else available) if r in self.loads]
        if not candidates:
            raise ValueError("no replica is available")
        turn = next(self._turn)
        if self.name == "round_robin":
            return Decision(
                candidates[turn % len(candidates)],
                self._matched(candidates[turn % len(candidates)], key),
                "round_robin",
            )
        if self.name == "least_load":
            replica = self._least_loaded(candidates, turn)
            return Decision(replica, self._matched(replica, key), "least_load")
        return self._cache_aware(key, candidates, turn)

    def on_dispatch(self, replica: str, key: PromptKey, num_requests: int = 1) -> None:
        """``num_requests`` were sent to ``replica`` for this prompt: count them and remember that
        the replica will cache the prompt."""
        if replica not in self.loads:
            return
        self.loads[replica] += num_requests
        self.prefixes[replica].insert(key.hashes)

    def on_finish(self, replica: str, num_requests: int = 1) -> None:
        """``num_requests`` sent to ``replica`` ended (finished, aborted or refused)."""
        if replica in self.loads:
            self.loads[replica] = max(0, self.loads[replica] - num_requests)

    def is_imbalanced(self, candidates: Sequence[str]) -> bool:
        loads = [self.loads[r] for r in candidates]
        busiest, idlest = max(loads), min(loads)
        return busiest - idlest > self.balance_abs and busiest > idlest * self.balance_rel

    # ------------------------------------------------------------------ helpers

    def _matched(self, replica: str, key: PromptKey) -> int:
        return self.prefixes[replica].match(key.hashes)

    def _least_loaded(self, candidates: Sequence[str], turn: int) -> str:
        # Rotating the start makes ties go round in turn.
        start = turn % len(candidates)
        rotated = [*candidates[start:], *candidates[:start]]
        return min(rotated, key=lambda r: self.loads[r])

    def _cache_aware(self, key: PromptKey, candidates: Sequence[str], turn: int) -> Decision:
        if len(candidates) > 1 and self.is_imbalanced(candidates):
            replica = self._least_loaded(candidates, turn)
            return Decision(replica, self._matched(replica, key), "balance")
        matched = {r: self._matched(r, key) for r in candidates}
        best = max(matched.values())
        tied = [r for r in candidates if matched[r] == best]
        start = turn % len(tied)
        rotated = [*tied[start:], *tied[:start]]
        if best > 0:
            replica = min(rotated, key=lambda r: (self.loads[r], len(self.prefixes[r])))
            return Decision(replica, best, "prefix")
        # A prefix nobody holds goes where it crowds out least: new prefixes spread evenly over the
        # caches instead of following momentary loads (the balance rule above bounds the loads).
        replica = min(rotated, key=lambda r: (len(self.prefixes[r]), self.loads[r]))
        return Decision(replica, 0, "new_prefix")
