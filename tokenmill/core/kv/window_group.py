"""A second KV group for models that mix sliding-window and full-attention layers (gpt-oss).

The full layers and the sliding layers keep their keys and values in separate pools (separate cache
tensors on the worker, ``worker/kv_groups.py``), each with its own block table per request:

- the *full group* is this manager itself (a plain ``KVCacheManager``): its table is the request's
  ``block_table`` and nothing is ever released from it;
- the *window group* is a second ``KVCacheManager`` over the sliding layers' pool, with the window
  set: the blocks behind the window go back to its pool as decoding proceeds
  (``release_out_of_window_blocks``), so a long generation holds at most
  ``cdiv(window, block_size) + 1`` of them (plus the step's new tokens).

Every step carries both tables: ``plan_state`` (the scheduler's per-entry hook) puts the window
group's table in ``ScheduledRequest.window_block_table``.

Prefix caching: each group has its own radix tree over the same tokens. A lookup matches both and
keeps the shorter match (cutting the longer one back), so a request resumes only where both groups
hold the prefix; where the window group's copy was evicted first, the positions past it are
recomputed (for both groups). A request publishes its prompt blocks to both trees; the window group
stops publishing once it releases blocks (``KVCacheManager.release_out_of_window_blocks``), which
waits until the prompt is computed. Sharing between requests (``share_prefix``) follows the same
rule: the shorter of the two shares wins.

Capacity: ``allocate_slots`` is all or nothing across both groups (the full group's new blocks are
given back when the window group has none), so the scheduler's preemption covers either pool running
dry. The worker sizes the window pool for ``max_num_seqs`` requests of ``cdiv(window, block_size) +
1`` blocks plus a step's tokens, and at least one whole context (a prompt is held whole until it is
computed, for the prefix cache).
"""

from __future__ import annotations

from tokenmill.core.kv.manager import KVAllocation, KVCacheManager
from tokenmill.core.request import Request
from tokenmill.core.step_io import ScheduledRequest


class WindowGroupKVManager(KVCacheManager):
    """The full layers' ``KVCacheManager`` plus ``window``, the sliding layers' (module docstring).

    Everything the scheduler reads about capacity (``num_blocks``, ``capacity_tokens``,
    ``block_table``) is the full group's; ``usage`` is the fuller of the two pools.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        window: int,
        num_window_blocks: int,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        if not 0 < num_window_blocks <= num_blocks:
            raise ValueError(f"the sliding-window pool needs 1..{num_blocks} blocks, got {num_window_blocks}")
        self.window = KVCacheManager(num_window_blocks, block_size, enable_prefix_caching, window)

    # ------------------------------------------------------------------ helpers

    def _cut(self, manager: KVCacheManager, request_id: str, num_blocks: int) -> None:
        """Cut ``manager``'s fresh (matched or shared, nothing computed yet) allocation back to its
        first ``num_blocks`` blocks. A lock on a deeper tree node stays until the request's first
        publish moves it (it only pins blocks longer)."""
        allocation = manager._allocations[request_id]
        extra = allocation.block_ids[num_blocks:]
        if extra:
            manager.pool.free(extra)
            del allocation.block_ids[num_blocks:]
        allocation.num_cached_blocks = min(allocation.num_cached_blocks, num_blocks)
        if num_blocks == 0 and allocation.locked_node is not None:
            manager.radix.unlock(allocation.locked_node)
            allocation.locked_node = None

    def _agree(self, request: Request, full_tokens: int, window_tokens: int) -> int:
        """Cut the group that got more back to the other's length; the tokens both hold."""
        tokens = min(full_tokens, window_tokens)
        blocks = tokens // self.block_size
        if full_tokens > tokens:
            self._cut(self, request.request_id, blocks)
            self.prefix_hit_tokens -= full_tokens - tokens
        if window_tokens > tokens:
            self._cut(self.window, request.request_id, blocks)
        return tokens

    # ------------------------------------------------------------------ KVCacheManager overrides

    def match_prefix(self, request: Request) -> int:
        """The prefix both groups' trees hold (the shorter match; see the module docstring)."""
        full_tokens = super().match_prefix(request)
        window_tokens = self.window.match_prefix(request)
        return self._agree(request, full_tokens, window_tokens)

    def peek_prefix_tokens(self, request: Request) -> int:
        return min(super().peek_prefix_tokens(request), self.window.peek_prefix_tokens(request))

    def share_prefix(
        self, source_id: str, request: Request, num_tokens: int, count_as_hit: bool = False
    ) -> int:
        full_tokens = super().share_prefix(source_id, request, num_tokens, count_as_hit)
        window_tokens = self.window.share_prefix(source_id, request, num_tokens)
        return self._agree(request, full_tokens, window_tokens)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Blocks in both groups, or none (the full group's new ones are given back)."""
        allocation = self._allocations.setdefault(request.request_id, KVAllocation())
        before = len(allocation.block_ids)
        if not super().allocate_slots(request, num_new_tokens):
            return False
        if self.window.allocate_slots(request, num_new_tokens):
            return True
        super().trim_slots(request, before * self.block_size)
        return False

    def plan_state(self, request: Request, entry: ScheduledRequest) -> None:
        """Put the window group's table in the entry (the sliding layers read it)."""
        entry.window_block_table = self.window.block_table(request.request_id)

    def trim_slots(self, request: Request, num_tokens: int) -> int:
        return super().trim_slots(request, num_tokens) + self.window.trim_slots(request, num_tokens)

    def cache_computed_blocks(self, request: Request) -> None:
        super().cache_computed_blocks(request)
        self.window.cache_computed_blocks(request)

    def release_out_of_window_blocks(self, request: Request) -> int:
        """Release the window group's blocks behind the window (the full group keeps all)."""
        return self.window.release_out_of_window_blocks(request)

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self.window.free(request_id)

    def reset_prefix_cache(self) -> bool:
        if any(a.locked_node is not None for a in self.window._allocations.values()):
            return False
        return super().reset_prefix_cache() and self.window.reset_prefix_cache()

    def start_weight_generation(self, generation: int) -> int:
        return super().start_weight_generation(generation) + self.window.start_weight_generation(generation)

    def usage(self) -> float:
        return max(super().usage(), self.window.usage())

    def num_window_held_blocks(self, request_id: str) -> int:
        """Blocks of the window group the request holds a reference on."""
        return self.window.num_held_blocks(request_id)

    def check_integrity(self) -> None:
        super().check_integrity()
        self.window.check_integrity()
        if set(self._allocations) != set(self.window._allocations):
            raise AssertionError("the two KV groups hold allocations for different requests")

    def all_free_or_cached(self) -> bool:
        return super().all_free_or_cached() and self.window.all_free_or_cached()

    def stats(self) -> dict[str, int | float | bool]:
        """``KVCacheManager.stats`` of the full group plus the window group's pool."""
        stats = super().stats()
        window = self.window.stats()
        stats["all_free_or_cached"] = self.all_free_or_cached()
        stats["usage"] = self.usage()
        stats.update(
            {
                "window_num_blocks": window["num_blocks"],
                "window_free_blocks": window["free_blocks"],
                "window_cached_blocks": window["cached_blocks"],
                "window_blocks_in_use": window["blocks_in_use"],
            }
        )
        return stats
