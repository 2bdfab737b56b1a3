"""KV blocks plus recurrent-state slots, for hybrid models (full attention mixed with linear attention).

The KV pool serves only the model's full-attention layers; each linear layer keeps a fixed-size state
per sequence in the state pool (``state_pool.py``). A running request holds one state slot, taken
with its first blocks (``allocate_slots`` fails, and the scheduler does not admit, when no slot can
be had) and returned by ``free``.

Prefix caching needs the state too: KV blocks alone cannot resume a recurrent layer mid-prefix. So
radix nodes may carry a *snapshot*: a slot holding the state after the node's last token. A step
that computes a block boundary the request wants to remember (every ``checkpoint_interval`` tokens
of a prompt, the last block boundaries of the prompt, and the latest block boundary of its output,
for the next turn of a chat) is planned with a checkpoint: the model copies the state there into a
fresh slot, and after the step the slot is attached to the tree node ending at that boundary. A
lookup takes the longest cached prefix and cuts it back to the deepest node on it with a snapshot;
the request's first step then starts by copying the snapshot into its own slot. Snapshots go with
their nodes when those are evicted, and on their own, least recently used first, when slots run out.

``n > 1`` siblings resume from their leader's snapshot at the end of the shared prompt blocks, once
the leader has computed it (never in the same step: the copy happens before the forward). Sharing
blocks that another request is still computing (in-flight prefixes) is not done for these models:
the state at the shared boundary would not exist yet.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.kv.manager import KVAllocation, KVCacheManager
from tokenmill.core.kv.state_pool import StatePool
from tokenmill.core.request import Request
from tokenmill.core.step_io import ScheduledRequest

logger = logging.getLogger(__name__)


@dataclass
class StateAllocation:
    """A request's state slots: its own, the snapshot it resumes from (held until its first step has
    run), and the snapshots it took that are not in the tree yet, by position. Each is one reference."""

    slot: int = -1
    source: int = -1
    snapshots: dict[int, int] = field(default_factory=dict)
    last_output_snapshot: Any = None  # the tree node of its latest output-boundary snapshot


class HybridKVCacheManager(KVCacheManager):
    """``KVCacheManager`` with a state slot per request and state snapshots on radix nodes (see the
    module docstring). ``reserved_slots`` (the scheduler's ``max_num_seqs``) slots are kept for
    running requests: snapshots never take the last of them."""

    same_step_sharing = False

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        num_state_slots: int,
        state_slot_bytes: int,
        checkpoint_interval: int,
        reserved_slots: int,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.states = StatePool(num_state_slots, state_slot_bytes)
        self.checkpoint_interval = checkpoint_interval
        self.reserved_slots = min(reserved_slots, num_state_slots)
        self._state: dict[str, StateAllocation] = {}
        self._snapshots: dict[Any, int] = {}  # radix node -> slot (the tree's reference)
        self._swept_version = -1
        self.num_preempted_states_kept = 0  # preempted requests whose state became a snapshot

    # ------------------------------------------------------------------ snapshots in the tree

    def _sweep(self) -> None:
        """Drop the snapshots of nodes the tree evicted or reset since the last look."""
        if self.radix is None or self._swept_version == self.radix.version:
            return
        dead = [node for node in self._snapshots if not node.alive]
        for node in dead:
            self.states.free([self._snapshots.pop(node)])
        self._swept_version = self.radix.version

    def _drop_snapshot(self, node: Any) -> None:
        slot = self._snapshots.pop(node, None)
        if slot is not None:
            self.states.free([slot])

    def _evict_one_snapshot(self) -> bool:
        """Drop the least recently used snapshot of the tree (its node and blocks stay)."""
        self._sweep()
        if not self._snapshots:
            return False
        node = min(self._snapshots, key=lambda n: (n.last_access, n.node_id))
        self._drop_snapshot(node)
        return True

    def _node_at(self, request: Request, num_tokens: int) -> Any:
        """The tree node whose path is exactly ``request``'s first ``num_tokens`` tokens (whole
        blocks, all cached), or None."""
        match = self.radix.match_prefix(self.namespace(request), request.all_token_ids[:num_tokens])
        return match.node if match.num_tokens == num_tokens and num_tokens > 0 else None

    # ------------------------------------------------------------------ slots

    def _take_slot(self, for_snapshot: bool) -> int | None:
        """A free slot (evicting tree snapshots if needed), or None. Snapshots leave enough free
        slots for ``reserved_slots`` running requests."""
        held = sum(1 for s in self._state.values() if s.slot >= 0)
        keep = max(0, self.reserved_slots - held) if for_snapshot else 0
        while self.states.num_free <= keep:
            if not self._evict_one_snapshot():
                return None
        return self.states.allocate(1)[0]

    def _release(self, slots: Sequence[int]) -> None:
        live = [s for s in slots if s >= 0]
        if live:
            self.states.free(live)

    # ------------------------------------------------------------------ KVCacheManager overrides

    def match_prefix(self, request: Request) -> int:
        """The longest cached prefix cut back to its deepest snapshot; the request will resume from
        that snapshot (see ``plan_state``)."""
        assert request.request_id not in self._allocations
        allocation = KVAllocation()
        self._allocations[request.request_id] = allocation
        state = self._state.setdefault(request.request_id, StateAllocation())
        limit = self._match_limit(request)
        if limit == 0:
            return 0
        self._sweep()
        self.prefix_queried_tokens += request.num_tokens
        match = self.radix.match_prefix(self.namespace(request), request.all_token_ids[:limit])
        node, num_blocks = match.node, match.num_blocks
        while not node.is_root and node not in self._snapshots:
            num_blocks -= node.num_blocks
            node = node.parent
        if num_blocks == 0:
            return 0
        blocks = match.block_ids[:num_blocks]
        self.pool.incref(blocks)
        self.radix.lock(node)
        allocation.block_ids = list(blocks)
        allocation.locked_node = node
        allocation.num_cached_blocks = num_blocks
        state.source = self._snapshots[node]
        self.states.incref([state.source])
        num_tokens = num_blocks * self.block_size
        self.prefix_hit_tokens += num_tokens
        return num_tokens

    def prefix_in_flight(self, request: Request, running: list[Request]) -> bool:
        return False  # the state at a boundary still being computed does not exist yet

    def prefix_computed_by(self, request: Request, planned: Sequence[tuple[Request, int]]) -> tuple[str, int]:
        return "", 0

    def share_prefix(
        self, source_id: str, request: Request, num_tokens: int, count_as_hit: bool = False
    ) -> int:
        """Share ``source_id``'s first blocks only up to a boundary where its state was snapshot
        (its prompt's last full block, once computed); nothing otherwise."""
        state = self._state.setdefault(request.request_id, StateAllocation())
        boundary = num_tokens // self.block_size * self.block_size
        snapshot = self._snapshot_of(source_id, request, boundary)
        if snapshot is None:
            self._allocations.setdefault(request.request_id, KVAllocation())
            return 0
        shared = super().share_prefix(source_id, request, boundary, count_as_hit)
        if shared == boundary:
            state.source = snapshot
            self.states.incref([snapshot])
            return shared
        self.trim_slots(request, 0)  # the source could not give all the blocks: compute afresh
        return 0

    def _snapshot_of(self, source_id: str, request: Request, boundary: int) -> int | None:
        if boundary == 0:
            return None
        source = self._state.get(source_id)
        if source is not None and boundary in source.snapshots:
            return source.snapshots[boundary]
        if self.radix is None:
            return None
        self._sweep()
        node = self._node_at(request, boundary)
        return self._snapshots.get(node) if node is not None else None

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Blocks as ``KVCacheManager.allocate_slots``, plus the request's state slot the first time.
        All or nothing."""
        state = self._state.setdefault(request.request_id, StateAllocation())
        taken = False
        if state.slot < 0:
            slot = self._take_slot(for_snapshot=False)
            if slot is None:
                return False
            state.slot, taken = slot, True
        if super().allocate_slots(request, num_new_tokens):
            self._sweep()
            return True
        if taken:
            self._release([state.slot])
            state.slot = -1
        self._sweep()
        return False

    def plan_state(self, request: Request, entry: ScheduledRequest) -> None:
        """Fill ``entry``'s state fields: the slot, the snapshot to resume from, and checkpoints (each
        with a fresh snapshot slot; skipped when none is free) at the boundaries in its range."""
        state = self._state.get(request.request_id)
        if state is None:
            return
        entry.state_slot = state.slot
        entry.state_source = state.source
        entry.state_checkpoints = []
        for position in self._checkpoint_positions(request, entry.start_position, entry.end_position):
            slot = state.snapshots.get(position)
            if slot is None:
                slot = self._take_slot(for_snapshot=True)
                if slot is None:
                    continue
                state.snapshots[position] = slot
            entry.state_checkpoints.append((position, slot))

    def _checkpoint_positions(self, request: Request, start: int, end: int) -> list[int]:
        bs = self.block_size
        allocation = self._allocations[request.request_id]
        publishes = self.radix is not None and not request.wants_prompt_logprobs and not allocation.detached
        has_siblings = request.group_id is not None and request.sibling_index == 0
        prompt = request.num_prompt_tokens
        prompt_ends = {(prompt - 1) // bs * bs, prompt // bs * bs}
        positions = []
        for position in range(-(-(start + 1) // bs) * bs, end + 1, bs):
            if position <= prompt:
                wanted = publishes and (position % self.checkpoint_interval == 0 or position in prompt_ends)
                wanted = wanted or (has_siblings and position == (prompt - 1) // bs * bs)
            else:
                wanted = publishes  # an output boundary: the next turn of a chat resumes there
            if wanted and position > 0:
                positions.append(position)
        return positions

    def cache_computed_blocks(self, request: Request) -> None:
        """Publish blocks as ``KVCacheManager.cache_computed_blocks``, then attach the snapshots the
        step took to their nodes; the snapshot the request resumed from is no longer needed."""
        state = self._state.get(request.request_id)
        if state is not None and state.source >= 0:
            self._release([state.source])
            state.source = -1
        super().cache_computed_blocks(request)
        if state is None or self.radix is None or request.wants_prompt_logprobs:
            return
        allocation = self._allocations[request.request_id]
        if allocation.detached:
            return
        cached = allocation.num_cached_blocks * self.block_size
        for position in sorted(p for p in state.snapshots if p <= cached):
            slot = state.snapshots.pop(position)
            node = self._node_at(request, position)
            if node is None or node in self._snapshots:
                self._release([slot])
                continue
            self._snapshots[node] = slot
            if position > request.num_prompt_tokens:
                previous = state.last_output_snapshot
                if previous is not None and previous is not node:
                    self._drop_snapshot(previous)  # only the latest output boundary is worth keeping
                state.last_output_snapshot = node
        self._sweep()

    def free_preempted(self, request: Request) -> None:
        """Release a preempted request, keeping its state when it can be resumed from: when its
        computed tokens end at a block boundary whose node is in the tree without a snapshot and the
        pool has a slot to spare (as for any snapshot), its own slot becomes that node's snapshot, so
        the recomputation restores it instead of starting over (``num_preempted_states_kept``).
        Otherwise it is recomputed from the deepest snapshot its prefix has, or from the start."""
        if self._keep_preempted_state(request):
            self.num_preempted_states_kept += 1
        self.free(request.request_id)

    def _keep_preempted_state(self, request: Request) -> bool:
        state = self._state.get(request.request_id)
        allocation = self._allocations.get(request.request_id)
        boundary = request.num_computed_tokens
        if state is None or allocation is None or state.slot < 0 or state.source >= 0:
            return False  # no slot, or its first step (which restores the source) has not run
        if self.radix is None or request.wants_prompt_logprobs or allocation.detached:
            return False
        if (
            boundary == 0
            or boundary % self.block_size
            or boundary > allocation.num_cached_blocks * self.block_size
        ):
            return False
        held = sum(1 for s in self._state.values() if s.slot >= 0) - 1  # the others' slots
        if self.states.num_free < max(0, self.reserved_slots - held):
            return False  # the slot is wanted by running requests
        self._sweep()
        node = self._node_at(request, boundary)
        if node is None or node in self._snapshots:
            return False
        self._snapshots[node] = state.slot  # the request's reference becomes the tree's
        state.slot = -1
        return True

    def free(self, request_id: str) -> None:
        state = self._state.pop(request_id, None)
        if state is not None:
            self._release([state.slot, state.source, *state.snapshots.values()])
        super().free(request_id)

    def reset_prefix_cache(self) -> bool:
        done = super().reset_prefix_cache()
        self._sweep()
        return done

    def start_weight_generation(self, generation: int) -> int:
        freed = super().start_weight_generation(generation)
        self._sweep()
        for state in self._state.values():  # snapshots of the old weights are never published
            self._release(list(state.snapshots.values()))
            state.snapshots.clear()
        return freed

    # ------------------------------------------------------------------ accounting

    def check_integrity(self) -> None:
        super().check_integrity()
        self._sweep()
        expected = [0] * self.states.num_slots
        for state in self._state.values():
            for slot in [state.slot, state.source, *state.snapshots.values()]:
                if slot >= 0:
                    expected[slot] += 1
        for node, slot in self._snapshots.items():
            if not node.alive:
                raise AssertionError(f"snapshot slot {slot} on a node no longer in the tree")
            expected[slot] += 1
        for slot, count in enumerate(expected):
            if self.states.ref_count(slot) != count:
                raise AssertionError(
                    f"state slot {slot}: ref count {self.states.ref_count(slot)}, holders {count}"
                )
        self.states.check_integrity()

    def all_free_or_cached(self) -> bool:
        self._sweep()
        return (
            super().all_free_or_cached() and not self._state and self.states.num_used == len(self._snapshots)
        )

    def stats(self) -> dict[str, int | float | bool]:
        """``KVCacheManager.stats`` plus the state pool: slots, free slots, snapshots and their bytes."""
        self._sweep()
        stats = super().stats()
        stats.update(
            {
                "state_slots": self.states.num_slots,
                "free_state_slots": self.states.num_free,
                "state_snapshots": len(self._snapshots),
                "state_snapshot_bytes": len(self._snapshots) * self.states.slot_bytes,
                "state_slot_bytes": self.states.slot_bytes,
            }
        )
        return stats


def make_kv_manager(config: EngineConfig, executor: Any) -> KVCacheManager:
    """The KV manager for the executor's model: a ``HybridKVCacheManager`` when its runner reports
    recurrent-state slots (``ModelRunner.recurrent_state_info``), a ``WindowGroupKVManager`` when it
    reports a sliding-window KV group (``ModelRunner.sliding_kv_pool_info``), else a plain
    ``KVCacheManager``."""
    cache = config.cache
    num_slots, slot_bytes = executor.collective_rpc("recurrent_state_info")[0]
    if not num_slots:
        window, num_window_blocks = executor.collective_rpc("sliding_kv_pool_info")[0]
        if window:  # sliding layers in a KV group of their own (core/kv/window_group.py)
            from tokenmill.core.kv.window_group import WindowGroupKVManager

            return WindowGroupKVManager(
                executor.num_blocks, cache.block_size, cache.enable_prefix_caching, window, num_window_blocks
            )
        return KVCacheManager(
            executor.num_blocks,
            cache.block_size,
            cache.enable_prefix_caching,
            sliding_window=executor.kv_window,
        )
    if config.executor_backend not in ("inprocess", "mp"):
        executor.shutdown()
        raise ValueError(
            f"recurrent-state models with executor_backend={config.executor_backend!r} are not supported "
            "yet; use the in-process executor"
        )
    interval = cache.state_checkpoint_interval or 4 * cache.block_size
    logger.info(
        "state pool: %d slots of %.2f MB; snapshots every %d tokens and at prompt ends",
        num_slots,
        slot_bytes / 1e6,
        interval,
    )
    return HybridKVCacheManager(
        executor.num_blocks,
        cache.block_size,
        cache.enable_prefix_caching,
        num_state_slots=num_slots,
        state_slot_bytes=slot_bytes,
        checkpoint_interval=interval,
        reserved_slots=config.scheduler.max_num_seqs,
    )
