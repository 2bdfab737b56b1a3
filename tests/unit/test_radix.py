"""RadixCache: prefix matching with splits, namespaces, duplicates, locking, LRU eviction, invariants."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tokenmill.core.kv.pool import BlockPool
from tokenmill.core.kv.radix import RadixCache


def make(num_blocks: int = 16, block_size: int = 2) -> tuple[BlockPool, RadixCache]:
    pool = BlockPool(num_blocks)
    return pool, RadixCache(pool, block_size)


def cache_tokens(pool: BlockPool, cache: RadixCache, tokens: list[int], namespace=None) -> list[int]:
    """Play a finished request: allocate its full blocks, insert them, drop its own references."""
    blocks = pool.allocate(len(tokens) // cache.block_size)
    result = cache.insert(namespace, tokens, blocks)
    pool.free(blocks)
    return result.block_ids


# ---------------------------------------------------------------- match / insert


def test_empty_cache_matches_nothing() -> None:
    pool, cache = make()
    m = cache.match_prefix(None, [1, 2, 3, 4])
    assert m.block_ids == [] and m.num_tokens == 0
    assert m.node.is_root
    cache.check_integrity()


def test_match_counts_only_full_blocks() -> None:
    pool, cache = make(block_size=4)
    blocks = cache_tokens(pool, cache, list(range(8)))
    assert cache.match_prefix(None, list(range(7))).block_ids == blocks[:1]
    assert cache.match_prefix(None, list(range(8))).block_ids == blocks
    assert cache.match_prefix(None, list(range(11))).num_tokens == 8
    assert cache.match_prefix(None, [0, 1, 2]).block_ids == []
    cache.check_integrity()


def test_match_splits_inside_an_edge() -> None:
    pool, cache = make()
    blocks = cache_tokens(pool, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    leaf = cache.match_prefix(None, [1, 2, 3, 4, 5, 6, 7, 8]).node
    assert leaf.block_ids == blocks

    m = cache.match_prefix(None, [1, 2, 3, 4, 9, 9])
    assert m.block_ids == blocks[:2]
    assert m.node.tokens == (1, 2, 3, 4) and m.node.block_ids == blocks[:2]
    # The old node keeps its identity and the lower half of the edge, under the new upper node.
    assert leaf.parent is m.node and leaf.block_ids == blocks[2:] and leaf.tokens == (5, 6, 7, 8)
    assert cache.cached_blocks == 4
    cache.check_integrity()

    # A match that runs out of tokens inside an edge splits too.
    m = cache.match_prefix(None, [1, 2, 3, 4, 5, 6])
    assert m.block_ids == blocks[:3] and m.node.block_ids == [blocks[2]]
    assert leaf.parent is m.node and leaf.block_ids == [blocks[3]]
    cache.check_integrity()


def test_insert_diverging_inside_an_edge_splits_and_branches() -> None:
    pool, cache = make()
    first = cache_tokens(pool, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    second = cache_tokens(pool, cache, [1, 2, 3, 4, 5, 6, 0, 0, 9, 9])
    assert second[:3] == first[:3] and second[3:] != first[3:]
    assert cache.cached_blocks == 6
    assert cache.match_prefix(None, [1, 2, 3, 4, 5, 6, 7, 8]).block_ids == first
    assert cache.match_prefix(None, [1, 2, 3, 4, 5, 6, 0, 0, 9, 9, 1]).block_ids == second
    split = cache.match_prefix(None, [1, 2, 3, 4, 5, 6]).node
    assert len(split.children) == 2
    cache.check_integrity()


def test_insert_of_a_prefix_of_an_edge_returns_a_node_covering_it() -> None:
    pool, cache = make()
    blocks = cache_tokens(pool, cache, [1, 2, 3, 4, 5, 6])
    own = pool.allocate(1)
    result = cache.insert(None, [1, 2], own)
    assert result.block_ids == blocks[:1] and result.duplicates == [0] and result.num_adopted == 0
    assert result.node.block_ids == blocks[:1]
    pool.free(own)
    cache.check_integrity()


def test_namespaces_never_share() -> None:
    pool, cache = make()
    tokens = [1, 2, 3, 4]
    a = cache_tokens(pool, cache, tokens, namespace=("lora-a", 0))
    assert cache.match_prefix(("lora-b", 0), tokens).block_ids == []
    assert cache.match_prefix(("lora-a", 1), tokens).block_ids == []
    assert cache.match_prefix(None, tokens).block_ids == []
    b = cache_tokens(pool, cache, tokens, namespace=("lora-b", 0))
    assert set(a).isdisjoint(b)
    assert cache.match_prefix(("lora-a", 0), tokens).block_ids == a
    assert cache.match_prefix(("lora-b", 0), tokens).block_ids == b
    assert cache.cached_blocks == 4
    cache.check_integrity()


def test_none_and_empty_tuple_are_the_default_namespace() -> None:
    pool, cache = make()
    blocks = cache_tokens(pool, cache, [1, 2], namespace=None)
    assert cache.match_prefix((), [1, 2]).block_ids == blocks


def test_duplicate_insert_returns_the_trees_blocks() -> None:
    pool, cache = make()
    tree = cache_tokens(pool, cache, [1, 2, 3, 4])
    own = pool.allocate(3)
    result = cache.insert(None, [1, 2, 3, 4, 5, 6], own)
    assert result.block_ids == tree + [own[2]]
    assert result.duplicates == [0, 1]
    assert result.num_adopted == 1
    assert pool.ref_count(own[2]) == 2  # the caller's and the tree's
    assert all(pool.ref_count(b) == 1 for b in own[:2])  # the tree did not take the duplicates
    pool.free(own)
    assert pool.num_used == 3 == cache.cached_blocks
    cache.check_integrity()


def test_insert_reusing_matched_blocks_reports_no_duplicates() -> None:
    pool, cache = make()
    tree = cache_tokens(pool, cache, [1, 2, 3, 4])
    m = cache.match_prefix(None, [1, 2, 3, 4, 5, 6])
    cache.lock(m.node)
    own = pool.allocate(1)
    result = cache.insert(None, [1, 2, 3, 4, 5, 6], m.block_ids + own)
    assert result.duplicates == [] and result.block_ids == tree + own
    pool.free(own)
    cache.unlock(m.node)
    cache.check_integrity()


def test_insert_rejects_bad_input() -> None:
    pool, cache = make()
    cached = cache_tokens(pool, cache, [1, 2])
    with pytest.raises(ValueError, match="len"):
        cache.insert(None, [1, 2, 3], [0])
    with pytest.raises(ValueError, match="already cached"):
        cache.insert(None, [7, 7], cached)
    free_block = pool.allocate(1)
    pool.free(free_block)
    with pytest.raises(ValueError, match="free"):
        cache.insert(None, [7, 7], free_block)
    own = pool.allocate(1)
    with pytest.raises(ValueError, match="twice"):
        cache.insert(None, [7, 7, 8, 8], own + own)
    pool.free(own)
    assert cache.cached_blocks == 1
    cache.check_integrity()


# ---------------------------------------------------------------- locking and eviction


def test_lock_prevents_eviction_of_node_and_ancestors() -> None:
    pool, cache = make()
    cache_tokens(pool, cache, [1, 2, 3, 4])
    cache_tokens(pool, cache, [1, 2, 3, 4, 5, 6])  # child of the first node
    deep = cache.match_prefix(None, [1, 2, 3, 4, 5, 6]).node
    cache.lock(deep)
    assert deep.parent is not None and deep.parent.lock_count == 1
    assert cache.evictable_blocks == 0
    assert cache.evict(10) == 0
    assert cache.cached_blocks == 3
    cache.check_integrity()

    cache.unlock(deep)
    assert cache.evictable_blocks == 3
    assert cache.evict(10) == 3
    assert pool.num_free == pool.num_blocks and cache.cached_blocks == 0
    cache.check_integrity()


def test_locked_leaf_keeps_path_but_unlocked_siblings_go() -> None:
    pool, cache = make()
    cache_tokens(pool, cache, [1, 1, 2, 2])
    cache_tokens(pool, cache, [1, 1, 3, 3])
    keep = cache.match_prefix(None, [1, 1, 2, 2]).node
    cache.lock(keep)
    assert cache.evictable_blocks == 1
    assert cache.evict(5) == 1
    assert cache.match_prefix(None, [1, 1, 3, 3]).num_blocks == 1
    assert cache.match_prefix(None, [1, 1, 2, 2]).num_blocks == 2
    cache.unlock(keep)
    cache.check_integrity()


def test_unlock_below_zero_raises() -> None:
    pool, cache = make()
    cache_tokens(pool, cache, [1, 2])
    node = cache.match_prefix(None, [1, 2]).node
    with pytest.raises(ValueError):
        cache.unlock(node)
    cache.lock(node)
    cache.unlock(node)
    with pytest.raises(ValueError):
        cache.unlock(node)
    cache.check_integrity()


def test_lock_of_an_evicted_node_raises() -> None:
    pool, cache = make()
    cache_tokens(pool, cache, [1, 2])
    node = cache.match_prefix(None, [1, 2]).node
    cache.evict(1)
    assert not node.alive
    with pytest.raises(ValueError):
        cache.lock(node)


def test_eviction_is_lru_over_leaves() -> None:
    pool, cache = make()
    a = cache_tokens(pool, cache, [1, 1])
    b = cache_tokens(pool, cache, [2, 2])
    c = cache_tokens(pool, cache, [3, 3])
    cache.match_prefix(None, [1, 1])  # touch a: now b is the oldest
    assert cache.evict(1) == 1
    assert pool.ref_count(b[0]) == 0 and cache.cached_blocks == 2
    assert cache.evict(1) == 1
    assert pool.ref_count(c[0]) == 0 and pool.ref_count(a[0]) == 1
    assert cache.match_prefix(None, [1, 1]).block_ids == a
    cache.check_integrity()


def test_eviction_takes_leaves_before_their_parents() -> None:
    pool, cache = make()
    cache_tokens(pool, cache, [1, 1, 2, 2, 3, 3])
    cache.match_prefix(None, [1, 1, 2, 2])  # split into [1,1,2,2] -> [3,3]
    cache_tokens(pool, cache, [9, 9])  # newer than the split path except for its touched part
    cache.match_prefix(None, [9, 9])
    # The old leaf [3,3] goes first, then its parent (now a leaf), before the newest [9,9].
    assert cache.evict(1) == 1
    assert cache.match_prefix(None, [1, 1, 2, 2, 3, 3]).num_blocks == 2
    cache.match_prefix(None, [9, 9])
    assert cache.evict(2) == 2
    assert cache.match_prefix(None, [1, 1, 2, 2]).num_blocks == 0
    assert cache.match_prefix(None, [9, 9]).num_blocks == 1
    cache.check_integrity()


def test_evict_counts_only_blocks_that_became_free() -> None:
    pool, cache = make()
    own = pool.allocate(2)
    cache.insert(None, [1, 1, 2, 2], own)  # the request still holds its references
    assert cache.evict(2) == 0  # the node is gone from the tree but its blocks stay in use
    assert cache.cached_blocks == 0
    assert [pool.ref_count(b) for b in own] == [1, 1]
    pool.free(own)
    assert pool.num_free == pool.num_blocks
    cache.check_integrity()


def test_evict_stops_when_enough_is_free() -> None:
    pool, cache = make()
    for t in range(4):
        cache_tokens(pool, cache, [t, t, t, t])
    assert cache.evict(3) == 4  # whole nodes go: two nodes of two blocks
    assert cache.cached_blocks == 4
    assert cache.evict(0) == 0
    cache.check_integrity()


def test_evictable_counter_follows_splits_and_locks() -> None:
    pool, cache = make()
    cache_tokens(pool, cache, [1, 1, 2, 2, 3, 3])
    m = cache.match_prefix(None, [1, 1, 2, 2])
    cache.lock(m.node)
    assert cache.evictable_blocks == 1
    cache.check_integrity()
    # Splitting the locked path again keeps the counts right.
    m2 = cache.match_prefix(None, [1, 1])
    assert m2.node.lock_count == 1 and cache.evictable_blocks == 1
    cache.check_integrity()
    cache.unlock(m.node)
    assert cache.evictable_blocks == 3
    cache.check_integrity()


def test_reset() -> None:
    pool, cache = make()
    cache_tokens(pool, cache, [1, 1, 2, 2])
    cache_tokens(pool, cache, [3, 3], namespace="x")
    node = cache.match_prefix("x", [3, 3]).node
    cache.lock(node)
    with pytest.raises(RuntimeError):
        cache.reset()
    assert cache.cached_blocks == 3
    cache.check_integrity()
    cache.unlock(node)
    assert cache.reset() == 3
    assert cache.cached_blocks == 0 and cache.evictable_blocks == 0 and not node.alive
    assert pool.num_free == pool.num_blocks
    assert cache.match_prefix(None, [1, 1]).block_ids == []
    cache.check_integrity()


# ---------------------------------------------------------------- property-based

VOCAB = st.integers(0, 2)  # tiny, so prefixes collide and edges split
NAMESPACES = st.sampled_from([None, "a", ("lora", 1)])
TOKENS = st.lists(VOCAB, max_size=12)


class RadixMachine(RuleBasedStateMachine):
    """Requests that match, allocate, insert and release, against a small pool, with eviction."""

    pool: BlockPool
    cache: RadixCache

    def __init__(self) -> None:
        super().__init__()
        self.locked: list = []  # nodes locked on behalf of "running" requests
        self.held: list[list[int]] = []  # block references still held by "running" requests
        self.known: dict[tuple, int] = {}  # (namespace, prefix tokens) -> block last cached for it

    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 3))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.cache = RadixCache(self.pool, block_size)

    def _ns(self, namespace):
        return () if namespace is None else namespace

    def _check_match(self, namespace, tokens: list[int], block_ids: list[int]) -> None:
        bs = self.cache.block_size
        for i, b in enumerate(block_ids):
            assert self.known[(self._ns(namespace), tuple(tokens[: (i + 1) * bs]))] == b

    @rule(
        namespace=NAMESPACES, tokens=TOKENS, use_cache=st.booleans(), keep=st.booleans(), hold=st.booleans()
    )
    def request(self, namespace, tokens: list[int], use_cache: bool, keep: bool, hold: bool) -> None:
        """A request computes its full blocks (reusing a cached prefix if use_cache) and caches them.

        keep: it stays running on the inserted node (locked); hold: it keeps its own references.
        """
        bs = self.cache.block_size
        n = len(tokens) // bs
        tokens = tokens[: n * bs]
        matched: list[int] = []
        match_node = None
        if use_cache:
            m = self.cache.match_prefix(namespace, tokens)
            self._check_match(namespace, tokens, m.block_ids)
            match_node = m.node
            self.cache.lock(match_node)
            matched = m.block_ids
        need = n - len(matched)
        if need > self.pool.num_free:
            before = self.pool.num_free
            freed = self.cache.evict(need - self.pool.num_free)
            assert self.pool.num_free - before == freed
        if need > self.pool.num_free:  # preempted: give back what it had and stop
            if match_node is not None:
                self.cache.unlock(match_node)
            return
        own = self.pool.allocate(need)
        result = self.cache.insert(namespace, tokens, matched + own)
        assert result.block_ids[: len(matched)] == matched
        if use_cache:
            assert result.duplicates == []  # nothing changed between match and insert
        assert result.node.block_ids == result.block_ids[n - result.node.num_blocks :]
        assert result.node.is_root == (n == 0)
        for i, b in enumerate(result.block_ids):
            self.known[(self._ns(namespace), tuple(tokens[: (i + 1) * bs]))] = b
        # Right after insert the whole sequence matches.
        assert self.cache.match_prefix(namespace, tokens).block_ids == result.block_ids
        dup_own = [own[i - len(matched)] for i in result.duplicates]
        adopted_own = [b for b in own if b not in dup_own]
        self.pool.free(dup_own)  # switch to the tree's copies
        if hold:
            self.held.append(adopted_own)
        else:
            self.pool.free(adopted_own)
        if keep:
            self.cache.lock(result.node)
            self.locked.append(result.node)
        if match_node is not None:
            self.cache.unlock(match_node)

    @rule(namespace=NAMESPACES, tokens=TOKENS)
    def match_and_lock(self, namespace, tokens: list[int]) -> None:
        m = self.cache.match_prefix(namespace, tokens)
        self._check_match(namespace, tokens, m.block_ids)
        assert m.node.block_ids == m.block_ids[len(m.block_ids) - m.node.num_blocks :]
        self.cache.lock(m.node)
        self.locked.append(m.node)

    @precondition(lambda self: self.locked)
    @rule(data=st.data())
    def unlock(self, data) -> None:
        i = data.draw(st.integers(0, len(self.locked) - 1))
        self.cache.unlock(self.locked.pop(i))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data) -> None:
        i = data.draw(st.integers(0, len(self.held) - 1))
        self.pool.free(self.held.pop(i))

    @rule(num_blocks=st.integers(0, 12))
    def evict(self, num_blocks: int) -> None:
        before = self.pool.num_free
        freed = self.cache.evict(num_blocks)
        assert self.pool.num_free - before == freed
        if freed < num_blocks:
            assert self.cache.evictable_blocks == 0  # it only stops short when nothing is left

    @precondition(lambda self: not self.locked)
    @rule()
    def reset(self) -> None:
        self.cache.reset()
        assert self.cache.cached_blocks == 0
        assert self.pool.num_used == len({b for blocks in self.held for b in blocks})

    @invariant()
    def integrity(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity()
        # Every reference is accounted for: one by the tree per cached block, one per holding request.
        expected = Counter(b for blocks in self.held for b in blocks)
        expected.update(self.cache.cached_block_ids())
        for b in range(self.pool.num_blocks):
            assert self.pool.ref_count(b) == expected[b]
        assert all(node.alive for node in self.locked)

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        for node in self.locked:
            self.cache.unlock(node)
        for blocks in self.held:
            self.pool.free(blocks)
        assert self.cache.evictable_blocks == self.cache.cached_blocks
        self.cache.evict(self.pool.num_blocks + 1)
        self.cache.check_integrity()
        assert self.cache.cached_blocks == 0
        assert self.pool.num_free == self.pool.num_blocks


RadixMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_radix_state_machine = RadixMachine.TestCase
