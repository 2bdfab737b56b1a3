"""The scheduler's only interface to the KV cache: block allocation, prefix matching, sharing.

Ownership rule: a request holds one pool reference on every block of its block table (shared
prefix blocks included); the radix tree holds one more on every block it caches. Freeing a request
drops its references; blocks then stay cached in the tree until evicted. A request also locks the
deepest tree node it uses so that eviction skips paths in use (evicting them would free nothing).

Sliding windows: when every layer of the model attends only to the last ``sliding_window``
positions, the leading blocks a running request's next queries can no longer see are released
(their table entries become ``RELEASED_BLOCK``), so a long generation holds a bounded number of
blocks. A request that released blocks no longer has its whole prefix, so it stops publishing
blocks to the prefix cache (see ``release_out_of_window_blocks``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.core.kv.pool import BlockPool
from tokenmill.core.request import Request
from tokenmill.core.step_io import RELEASED_BLOCK, ScheduledRequest

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class KVAllocation:
    """A request's KV blocks: its block table and how much of it the radix tree already holds.

    The first ``num_released`` entries of ``block_ids`` are ``RELEASED_BLOCK``; ``detached`` is set
    once the request released blocks under a prefix cache, after which it publishes nothing more.
    """

    block_ids: list[int] = field(default_factory=list)
    locked_node: Any = None
    num_cached_blocks: int = 0
    num_released: int = 0
    detached: bool = False

    @property
    def held_block_ids(self) -> list[int]:
        """The blocks this allocation holds a pool reference on."""
        return self.block_ids[self.num_released :]


class KVCacheManager:
    """Hands out KV blocks to requests, with an optional radix-tree prefix cache.

    Contract: ``allocate_slots`` either reserves every block a step needs or reserves nothing and
    returns False (the scheduler then preempts); ``free`` returns a request's references exactly
    once; ``cache_computed_blocks`` publishes a request's full, computed blocks to the prefix cache.
    ``same_step_sharing``: a request may share blocks computed in the step being planned (not for
    recurrent-state models, ``core/kv/hybrid.py``).
    """

    same_step_sharing = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        """``sliding_window``: the number of trailing positions that every layer of the model attends
        to (None when any layer attends to the whole sequence: then no block is ever released)."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.sliding_window = sliding_window
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.radix: Any = None
        if enable_prefix_caching:
            from tokenmill.core.kv.radix import RadixCache

            self.radix = RadixCache(self.pool, block_size)
        self._allocations: dict[str, KVAllocation] = {}
        # peek_prefix_tokens answers by (request id, its token count) while the tree's version holds.
        self._peeked: dict[tuple[str, int], int] = {}
        self._peeked_version = -1
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.weight_generation = 0  # bumped by every weight update (start_weight_generation)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def usage(self) -> float:
        """Fraction of blocks held by requests (blocks only cached in the tree count as free)."""
        evictable = self.radix.evictable_blocks if self.radix is not None else 0
        return (self.pool.num_used - evictable) / self.pool.num_blocks

    def num_available_blocks(self) -> int:
        evictable = self.radix.evictable_blocks if self.radix is not None else 0
        return self.pool.num_free + evictable

    def block_table(self, request_id: str) -> list[int]:
        return self._allocations[request_id].block_ids

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds a reference on (its table minus released entries)."""
        return len(self._allocations[request_id].held_block_ids)

    def has_allocation(self, request_id: str) -> bool:
        return request_id in self._allocations

    def namespace(self, request: Request) -> tuple[str | int | None, ...]:
        """A request's radix namespace: its cache salt, the weights' generation (KV computed under
        other weights is never matched, ``start_weight_generation``) and its LoRA adapter load (None:
        the base model), since an adapter changes every layer's keys and values."""
        return (request.cache_salt, self.weight_generation, request.lora_id)

    def start_weight_generation(self, generation: int) -> int:
        """New weights from now on: KV computed before is stale. Every live allocation stops
        publishing to the tree (its blocks, possibly part old and part new, are its own until it
        ends) and unlocks its path; then the tree drops every block, and lookups use the new
        generation's namespace. Returns how many blocks became free."""
        self.weight_generation = generation
        self._peeked.clear()
        for allocation in self._allocations.values():
            if allocation.locked_node is not None:
                self.radix.unlock(allocation.locked_node)
                allocation.locked_node = None
            allocation.detached = True
        return self.radix.reset() if self.radix is not None else 0

    def match_prefix(self, request: Request) -> int:
        """Take the longest cached prefix of ``request``'s tokens; returns its length in tokens.

        At least one token is always left to compute so the step has logits to sample from, and
        requests asking for prompt logprobs match only what lies before the position whose logits
        give their first wanted logprob (cached positions have no logits).
        Must be called only for a request with no allocation yet.
        """
        assert request.request_id not in self._allocations
        allocation = KVAllocation()
        self._allocations[request.request_id] = allocation
        limit = self._match_limit(request)
        if limit == 0:
            return 0
        self.prefix_queried_tokens += request.num_tokens
        match = self.radix.match_prefix(self.namespace(request), request.all_token_ids[:limit])
        if not match.block_ids:
            return 0
        self.pool.incref(match.block_ids)
        self.radix.lock(match.node)
        allocation.block_ids = list(match.block_ids)
        allocation.locked_node = match.node
        allocation.num_cached_blocks = len(match.block_ids)
        num_tokens = len(match.block_ids) * self.block_size
        self.prefix_hit_tokens += num_tokens
        return num_tokens

    def _match_limit(self, request: Request) -> int:
        """How many leading tokens of ``request`` may come from the tree (whole blocks): all but the
        last one, and for prompt logprobs none from the row before ``prompt_logprobs_start`` on."""
        if self.radix is None:
            return 0
        end = request.num_tokens - 1
        if request.wants_prompt_logprobs:
            end = min(end, request.sampling_params.prompt_logprobs_start - 1)
        return max(end, 0) // self.block_size * self.block_size

    def peek_prefix_tokens(self, request: Request) -> int:
        """Cached prefix length of a waiting request, in tokens, changing nothing (for policies).

        A step asks this of the same request several times (the ``lpm`` ranking, the ``ttft``
        admission, in-flight prefix checks); the tree is walked once per request and tree version
        (a request's tokens only grow, so its id and token count name them).
        """
        limit = self._match_limit(request)
        if self.radix is None or limit == 0:
            return 0
        if self._peeked_version != self.radix.version:
            self._peeked.clear()
            self._peeked_version = self.radix.version
        key = (request.request_id, request.num_tokens)
        tokens = self._peeked.get(key)
        if tokens is None:
            blocks = self.radix.peek_prefix_blocks(self.namespace(request), request.all_token_ids[:limit])
            tokens = self._peeked[key] = int(blocks) * self.block_size
        return tokens

    def prefix_in_flight(self, request: Request, running: list[Request]) -> bool:
        """Whether a running request is still computing blocks that would extend ``request``'s cached
        prefix: a waiting request that starts with those blocks does better to match them once they
        are computed (maybe in the very step that computes them: ``prefix_computed_by``) than to
        compute a copy of them alongside (in-batch prefix sharing).

        Only requests that publish their blocks to the tree count (same namespace, no prompt
        logprobs, not detached), and only blocks beyond what the tree already holds for ``request``.
        Changes nothing.
        """
        cached_blocks: int | None = None
        for other, shared in self._publishers_sharing(request, running):
            if shared * self.block_size <= other.num_computed_tokens:
                continue  # the shared blocks are computed and published already
            if cached_blocks is None:
                cached_blocks = self.peek_prefix_tokens(request) // self.block_size
            if shared > cached_blocks:
                return True
        return False

    def prefix_computed_by(self, request: Request, planned: Sequence[tuple[Request, int]]) -> tuple[str, int]:
        """The request, and how many of ``request``'s leading tokens (whole blocks), whose blocks
        ``request`` can share once the step being planned has run, when that is more than the tree
        holds for it; ``("", 0)`` otherwise. ``planned`` pairs each running request with a prompt
        chunk in that step with the number of tokens it will have computed after it.

        Sharing is safe in the same step: each layer writes the step's new keys and values to the
        cache before any sequence attends (the attention backends' contract), so a sequence whose
        block table starts with another's blocks reads them freshly written. Changes nothing.
        """
        best_id, best_blocks = "", 0
        computed_after = {r.request_id: n for r, n in planned}
        for other, shared in self._publishers_sharing(request, [r for r, _ in planned]):
            shared = min(shared, computed_after[other.request_id] // self.block_size)
            if shared > best_blocks:
                best_id, best_blocks = other.request_id, shared
        if best_blocks <= self.peek_prefix_tokens(request) // self.block_size:
            return "", 0
        return best_id, best_blocks * self.block_size

    def _publishers_sharing(
        self, request: Request, running: Sequence[Request]
    ) -> Iterator[tuple[Request, int]]:
        """The requests of ``running`` still computing their prompt whose blocks would reach the tree
        where ``request`` can match them, each with the number of leading full blocks it shares with
        ``request`` (at least one token of ``request`` is always left to compute)."""
        if self.radix is None or request.wants_prompt_logprobs:
            return
        namespace = self.namespace(request)
        limit_blocks = (request.num_tokens - 1) // self.block_size
        for other in running:
            if other.num_computed_tokens >= other.num_prompt_tokens or other.wants_prompt_logprobs:
                continue  # decoding (its prompt blocks are published) or never publishing
            allocation = self._allocations.get(other.request_id)
            if allocation is None or allocation.detached or self.namespace(other) != namespace:
                continue
            shared = _common_full_blocks(
                request.all_token_ids, other.prompt_token_ids, self.block_size, limit_blocks
            )
            if shared > 0:
                yield other, shared

    def share_prefix(
        self, source_id: str, request: Request, num_tokens: int, count_as_hit: bool = False
    ) -> int:
        """Give a fresh ``request`` the first full blocks of ``source_id``'s table (n > 1 siblings, or
        a request whose prefix another computes in the step being planned: ``prefix_computed_by``).

        Shares ``num_tokens // block_size`` blocks, bumping their reference counts; returns the
        number of tokens shared. The caller guarantees those tokens are identical and computed (by
        the time the request attends). ``count_as_hit`` counts the lookup and the shared tokens in the
        prefix-cache metrics, as a match in the tree would be.
        """
        allocation = self._allocations.setdefault(request.request_id, KVAllocation())
        assert not allocation.block_ids, "share_prefix needs an empty allocation"
        source = self._allocations[source_id]
        num_shared = min(num_tokens // self.block_size, len(source.block_ids))
        if source.num_released or source.detached:
            # The source no longer holds the start of the prefix, or holds it under older weights:
            # compute it afresh.
            num_shared = 0
        shared = source.block_ids[:num_shared]
        self.pool.incref(shared)
        allocation.block_ids = list(shared)
        if count_as_hit:
            self.prefix_queried_tokens += request.num_tokens
            self.prefix_hit_tokens += num_shared * self.block_size
        return num_shared * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Reserve blocks so ``request`` can hold ``num_computed_tokens + num_new_tokens`` tokens.

        Evicts unlocked cached blocks when the free list is short. All or nothing.
        """
        allocation = self._allocations.setdefault(request.request_id, KVAllocation())
        needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(
            allocation.block_ids
        )
        if needed <= 0:
            return True
        if self.pool.num_free < needed and self.radix is not None:
            self.radix.evict(needed - self.pool.num_free)
        if self.pool.num_free < needed:
            return False
        allocation.block_ids.extend(self.pool.allocate(needed))
        return True

    def plan_state(self, request: Request, entry: ScheduledRequest) -> None:
        """Fill ``entry``'s recurrent-state fields; nothing to do for a model without such state."""

    def trim_slots(self, request: Request, num_tokens: int) -> int:
        """Give back the blocks past the first ``num_tokens`` tokens of ``request``'s table (slots
        reserved for draft tokens the verification rejected); returns how many. Those blocks hold
        only unverified positions, never in the prefix cache (it caches computed, verified blocks)."""
        allocation = self._allocations.get(request.request_id)
        if allocation is None:
            return 0
        keep = max(cdiv(num_tokens, self.block_size), allocation.num_released)
        extra = allocation.block_ids[keep:]
        if extra:
            self.pool.free(extra)
            del allocation.block_ids[keep:]
        return len(extra)

    def cache_computed_blocks(self, request: Request) -> None:
        """Insert ``request``'s newly completed full blocks into the prefix cache.

        Called after each step, so concurrent requests with a common prefix share it as soon as it
        is computed. If the tree already held an identical block (computed concurrently by another
        request), the request switches to the tree's copy and drops its own.
        """
        if self.radix is None or request.wants_prompt_logprobs:
            return
        allocation = self._allocations[request.request_id]
        if allocation.detached:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(allocation.block_ids))
        if num_full <= allocation.num_cached_blocks:
            return
        tokens = request.all_token_ids[: num_full * self.block_size]
        result = self.radix.insert(self.namespace(request), tokens, allocation.block_ids[:num_full])
        for i, tree_block in enumerate(result.block_ids):
            own = allocation.block_ids[i]
            if tree_block != own:
                self.pool.incref([tree_block])
                self.pool.free([own])
                allocation.block_ids[i] = tree_block
        self.radix.lock(result.node)
        if allocation.locked_node is not None:
            self.radix.unlock(allocation.locked_node)
        allocation.locked_node = result.node
        allocation.num_cached_blocks = num_full

    def release_out_of_window_blocks(self, request: Request) -> int:
        """Release the leading blocks that no layer's window can reach any more; returns how many.

        Call after ``request.num_computed_tokens`` advanced (and after ``cache_computed_blocks``). Its
        next query sits at position ``num_computed_tokens`` and sees positions from
        ``num_computed_tokens - sliding_window + 1`` on, so every block wholly before that is released:
        the request drops its reference (a block the prefix tree also holds stays cached there).

        Under a prefix cache, releasing waits until the whole prompt is computed, so the prompt's full
        blocks reach the tree first; then the request unlocks its tree path (a prefix whose first
        blocks it no longer holds is not its to pin) and publishes nothing more: a later block cannot
        be inserted without the blocks before it. Requests with prompt logprobs never touch the tree.
        Does nothing when the model has a global layer (``sliding_window`` None).
        """
        if self.sliding_window is None:
            return 0
        allocation = self._allocations.get(request.request_id)
        if allocation is None:
            return 0
        first_visible = request.num_computed_tokens - self.sliding_window + 1
        num_releasable = min(max(first_visible, 0) // self.block_size, len(allocation.block_ids))
        if num_releasable <= allocation.num_released:
            return 0
        if self.radix is not None and not request.wants_prompt_logprobs:
            if request.num_computed_tokens < request.num_prompt_tokens:
                return 0
            if allocation.locked_node is not None:
                self.radix.unlock(allocation.locked_node)
                allocation.locked_node = None
            allocation.detached = True
        start = allocation.num_released
        self.pool.free(allocation.block_ids[start:num_releasable])
        allocation.block_ids[start:num_releasable] = [RELEASED_BLOCK] * (num_releasable - start)
        allocation.num_released = num_releasable
        return num_releasable - start

    def free_preempted(self, request: Request) -> None:
        """Release a preempted request's blocks (as ``free``); managers with per-request state may keep
        what can be reused when it is recomputed."""
        self.free(request.request_id)

    def free(self, request_id: str) -> None:
        """Drop the request's references and lock; its cached blocks stay in the tree."""
        allocation = self._allocations.pop(request_id, None)
        if allocation is None:
            return
        if allocation.locked_node is not None:
            self.radix.unlock(allocation.locked_node)
        self.pool.free(allocation.held_block_ids)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block not in use; False if requests still hold tree nodes."""
        if self.radix is None:
            return True
        if any(a.locked_node is not None for a in self._allocations.values()):
            return False
        self.radix.reset()
        return True

    def check_integrity(self) -> None:
        """Assert pool and tree invariants and that request references account for every count."""
        if self.radix is not None:
            self.radix.check_integrity()
        else:
            self.pool.check_integrity()
        expected = [0] * self.pool.num_blocks
        for allocation in self._allocations.values():
            released = allocation.block_ids[: allocation.num_released]
            if any(b != RELEASED_BLOCK for b in released) or RELEASED_BLOCK in allocation.held_block_ids:
                raise AssertionError(
                    f"released entries are not exactly the table's first {allocation.num_released}"
                )
            for b in allocation.held_block_ids:
                expected[b] += 1
        if self.radix is not None:
            for b in self.radix.cached_block_ids():
                expected[b] += 1
        for b, count in enumerate(expected):
            if self.pool.ref_count(b) != count:
                raise AssertionError(f"block {b}: ref count {self.pool.ref_count(b)}, holders {count}")

    def all_free_or_cached(self) -> bool:
        """True when no request holds blocks: every block is free or held only by the tree."""
        return not self._allocations and self.pool.num_used == (
            self.radix.cached_blocks if self.radix is not None else 0
        )

    def stats(self) -> dict[str, int | float | bool]:
        """Live block counts for operators (``kv_stats``): the pool's size, free blocks, blocks only
        the prefix cache keeps, blocks some request holds, and the usage gauge. A snapshot: read it
        between steps; every key is present whether or not prefix caching is on."""
        cached = self.radix.cached_blocks if self.radix is not None else 0
        evictable = self.radix.evictable_blocks if self.radix is not None else 0
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "free_blocks": self.pool.num_free,
            "cached_blocks": cached,
            # Blocks some request holds: used blocks minus those only the prefix cache keeps.
            "blocks_in_use": self.pool.num_used - evictable,
            "usage": self.usage(),
            "all_free_or_cached": self.all_free_or_cached(),
        }


def _common_full_blocks(a: list[int], b: list[int], block_size: int, limit_blocks: int) -> int:
    """How many leading ``block_size`` blocks ``a`` and ``b`` have in common, at most ``limit_blocks``."""
    num_blocks = min(len(a) // block_size, len(b) // block_size, limit_blocks)
    matched = 0
    while matched < num_blocks:
        start = matched * block_size
        if a[start : start + block_size] != b[start : start + block_size]:
            break
        matched += 1
    return matched
