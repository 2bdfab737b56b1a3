"""A radix tree of cached KV blocks, keyed by namespace and token ids (RadixAttention's prefix cache).

Each namespace (LoRA adapter, weight version, cache salt, ...) has its own root, so keys from different
namespaces never share a node. Every edge below a root is a run of whole blocks: ``k * block_size``
tokens and the ``k`` block ids that hold their KV. Only full blocks are ever cached; a request's
partial last block stays its own.

Ownership: the tree holds exactly one pool reference on every block it caches and drops it when the
node is evicted. A request that uses cached blocks must :meth:`RadixCache.lock` the node that covers
them first; a locked node (and so each of its ancestors) is never evicted. Ints only, no torch.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.core.kv.pool import BlockPool

_DEFAULT_NAMESPACE: Hashable = ()


class RadixNode:
    """One node of the tree: a block-aligned run of tokens and the blocks that hold them.

    A root has no tokens and no blocks. Callers may read the attributes but must not change them; a
    node handed out by the cache must be locked before its blocks are used and stays valid (``alive``)
    until it is evicted or the cache is reset, which can only happen while it is unlocked.
    """

    __slots__ = (
        "alive",
        "block_ids",
        "children",
        "last_access",
        "lock_count",
        "namespace",
        "node_id",
        "parent",
        "tokens",
    )

    def __init__(
        self,
        node_id: int,
        namespace: Hashable,
        tokens: tuple[int, ...],
        block_ids: list[int],
        parent: RadixNode | None,
        last_access: int,
    ) -> None:
        self.node_id = node_id
        self.namespace = namespace
        self.tokens = tokens
        self.block_ids = block_ids
        self.parent = parent
        # Keyed by the tokens of the child's first block: siblings always differ there.
        self.children: dict[tuple[int, ...], RadixNode] = {}
        # Locks taken on this node plus every lock taken on a descendant.
        self.lock_count = 0
        self.last_access = last_access
        self.alive = True

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def __repr__(self) -> str:
        return (
            f"RadixNode(id={self.node_id}, ns={self.namespace!r}, blocks={self.block_ids}, "
            f"locks={self.lock_count}, children={len(self.children)})"
        )


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a token sequence.

    ``block_ids`` are the tree's blocks for the matched prefix, in order; ``node`` is the deepest node
    of the matched path and covers exactly those blocks (the namespace root when nothing matched).
    The blocks stay valid only while ``node`` is locked: lock it before the cache is touched again.
    """

    block_ids: list[int]
    node: RadixNode
    block_size: int

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.block_ids) * self.block_size


@dataclass(frozen=True)
class InsertResult:
    """The outcome of :meth:`RadixCache.insert`.

    ``block_ids[i]`` is the tree's block for position ``i`` (the caller's own block where the tree
    adopted it). ``duplicates`` lists the positions where the tree already held those tokens in a
    different block: the caller should switch to the tree's block and free its own. ``node`` is the
    deepest node of the inserted path and covers exactly the inserted blocks; lock it to keep using
    them. ``num_adopted`` counts the caller's blocks the tree newly took a reference on.
    """

    block_ids: list[int]
    duplicates: list[int]
    node: RadixNode
    num_adopted: int


class RadixCache:
    """Prefix cache over a :class:`BlockPool`: match, insert, lock/unlock and LRU eviction.

    Contract:
      * Namespaces are hashable; ``None`` and ``()`` both mean the default namespace.
      * The tree takes one pool reference on each block it adopts in :meth:`insert` and drops it
        when the block's node is evicted or reset; it never touches the caller's references.
      * A node must be locked before its blocks are used, and unlocked exactly once per lock.
        Locking a node locks its whole path, so a locked node's ancestors are never evicted.
      * :meth:`match_prefix` and :meth:`insert` may split nodes; a split keeps every existing node
        covering a suffix of its old blocks, so held locks stay correct.
    """

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self._roots: dict[Hashable, RadixNode] = {}
        # Childless non-root nodes: the only eviction candidates, kept so evict need not walk the tree.
        self._leaves: set[RadixNode] = set()
        self._tree_blocks: set[int] = set()
        self._evictable_blocks = 0
        self._node_ids = itertools.count()
        # A logical clock: strictly increasing, so LRU order is exact and deterministic.
        self._clock = 0
        # Bumped whenever the cached token runs change (insert adopts blocks, evict, reset); splits
        # and locks leave it: what a lookup finds is the same for the same version.
        self.version = 0
        # Told of every node stored and removed and of resets (``core/kv/kv_events.py``); None: nobody.
        self.observer: Any = None

    # ------------------------------------------------------------------ queries

    @property
    def evictable_blocks(self) -> int:
        """Blocks held by unlocked nodes (an upper bound on what :meth:`evict` can release)."""
        return self._evictable_blocks

    @property
    def cached_blocks(self) -> int:
        """Blocks held by the tree, locked or not."""
        return len(self._tree_blocks)

    def cached_block_ids(self) -> frozenset[int]:
        """The ids of every block the tree holds a reference on."""
        return frozenset(self._tree_blocks)

    # ------------------------------------------------------------------ match / insert

    def match_prefix(self, namespace: Hashable, tokens: Sequence[int]) -> PrefixMatch:
        """Find the longest cached prefix of ``tokens`` in ``namespace``, in whole blocks.

        Only the full blocks of ``tokens`` are looked at. If the match ends inside an edge, that node is
        split at the block boundary so the returned node covers exactly the matched blocks. Every node on
        the path counts as accessed for LRU. Takes no lock and no pool reference: the caller must
        lock ``result.node`` before the blocks are used and before anything can evict.
        """
        num_full = len(tokens) // self.block_size
        key = tuple(tokens[: num_full * self.block_size])
        node, block_ids = self._descend(self._root(namespace), key)
        return PrefixMatch(block_ids=block_ids, node=node, block_size=self.block_size)

    def peek_prefix_blocks(self, namespace: Hashable, tokens: Sequence[int]) -> int:
        """How many whole blocks of ``tokens`` are cached, without splitting or touching LRU times.

        For scheduling policies that rank waiting requests by their cached prefix.
        """
        bs = self.block_size
        root = self._roots.get(_DEFAULT_NAMESPACE if namespace is None else namespace)
        if root is None:
            return 0
        node, pos, matched_blocks = root, 0, 0
        while pos + bs <= len(tokens):
            child = node.children.get(tuple(tokens[pos : pos + bs]))
            if child is None:
                break
            for i in range(child.num_blocks):
                start = pos + i * bs
                if (
                    start + bs > len(tokens)
                    or tuple(tokens[start : start + bs]) != child.tokens[i * bs : (i + 1) * bs]
                ):
                    return matched_blocks
                matched_blocks += 1
            pos += child.num_blocks * bs
            node = child
        return matched_blocks

    def insert(self, namespace: Hashable, tokens: Sequence[int], block_ids: Sequence[int]) -> InsertResult:
        """Cache ``tokens`` (exactly ``len(block_ids) * block_size`` of them) backed by ``block_ids``.

        Positions whose tokens are already cached keep the tree's block (see ``InsertResult``); the
        remaining blocks are adopted, the tree taking one pool reference on each. Adopted blocks must
        be in use (ref count >= 1) and not already in the tree. The caller's own references are left
        untouched: it still frees them itself. The inserted path counts as accessed for LRU. On a
        ValueError nothing is adopted (a split may already have happened; the tree stays consistent).
        """
        if len(tokens) != len(block_ids) * self.block_size:
            raise ValueError(
                f"insert needs len(tokens) == len(block_ids) * block_size, "
                f"got {len(tokens)} tokens, {len(block_ids)} blocks of {self.block_size}"
            )
        key = tuple(tokens)
        node, tree_blocks = self._descend(self._root(namespace), key)
        num_matched = len(tree_blocks)
        new_blocks = list(block_ids[num_matched:])
        self._check_adoptable(new_blocks)
        if new_blocks:
            leaf = RadixNode(
                node_id=next(self._node_ids),
                namespace=node.namespace,
                tokens=key[num_matched * self.block_size :],
                block_ids=new_blocks,
                parent=node,
                last_access=self._clock,
            )
            self.pool.incref(new_blocks)
            self._attach(node, leaf)
            self._tree_blocks.update(new_blocks)
            self._evictable_blocks += len(new_blocks)  # a new node starts unlocked
            self.version += 1
            node = leaf
            if self.observer is not None:
                self.observer.on_stored(leaf)
        duplicates = [i for i in range(num_matched) if tree_blocks[i] != block_ids[i]]
        return InsertResult(
            block_ids=tree_blocks + new_blocks, duplicates=duplicates, node=node, num_adopted=len(new_blocks)
        )

    # ------------------------------------------------------------------ locking

    def lock(self, node: RadixNode) -> None:
        """Pin ``node`` and all its ancestors so none of them can be evicted.

        Every lock must be matched by exactly one :meth:`unlock` of the same node. The node must be
        alive (not evicted or reset); locking a namespace root is allowed and pins nothing but the root.
        """
        if not node.alive:
            raise ValueError(f"cannot lock a node no longer in the tree: {node!r}")
        cur: RadixNode | None = node
        while cur is not None:
            if cur.lock_count == 0:
                self._evictable_blocks -= cur.num_blocks
            cur.lock_count += 1
            cur = cur.parent

    def unlock(self, node: RadixNode) -> None:
        """Release one lock taken by :meth:`lock` on ``node``. Raises ValueError if it holds none."""
        if node.lock_count <= 0:
            raise ValueError(f"unlock of a node that is not locked: {node!r}")
        cur: RadixNode | None = node
        while cur is not None:
            cur.lock_count -= 1
            if cur.lock_count == 0:
                self._evictable_blocks += cur.num_blocks
            cur = cur.parent

    # ------------------------------------------------------------------ eviction

    def evict(self, num_blocks: int) -> int:
        """Drop unlocked leaves, least recently accessed first, until ``num_blocks`` blocks are free.

        Returns how many blocks actually returned to the pool's free list: a block that a request still
        references only loses the tree's reference, so the result can be below the number of blocks
        removed from the tree. Removing a leaf can make its parent an evictable leaf, which then joins
        the candidates. Stops early when nothing unlocked is left (then ``evictable_blocks == 0``).
        """
        freed = 0
        if num_blocks > 0:
            heap = [(n.last_access, n.node_id, n) for n in self._leaves if n.lock_count == 0]
            heapq.heapify(heap)
            while freed < num_blocks and heap:
                _, _, node = heapq.heappop(heap)
                parent = node.parent
                assert parent is not None
                freed += self._remove_leaf(node)
                if not parent.is_root and not parent.children and parent.lock_count == 0:
                    heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        self._prune_roots()
        return freed

    def reset(self) -> int:
        """Drop every node and the tree's reference on every block; returns how many blocks became free.

        Raises RuntimeError (changing nothing) if any node is locked: a locked node's blocks are in use.
        """
        locked = [ns for ns, root in self._roots.items() if root.lock_count > 0]
        if locked:
            raise RuntimeError(f"cannot reset the radix cache: nodes are locked in namespaces {locked!r}")
        freed = 0
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            freed += self._release_blocks(node.block_ids)
            node.alive = False
        self._roots.clear()
        self._leaves.clear()
        self._tree_blocks.clear()
        self._evictable_blocks = 0
        self.version += 1
        if self.observer is not None:
            self.observer.on_cleared()
        return freed

    # ------------------------------------------------------------------ integrity

    def check_integrity(self) -> None:
        """Assert every invariant of the tree, then the pool's; raises AssertionError on the first breach.

        Checks: edges are whole blocks and children are keyed by their first block; parent links and
        ``alive`` flags agree with the structure; lock counts are non-negative and a node's count covers
        the sum of its children's; LRU stamps never grow downwards; no block appears twice and each has
        pool ref count >= 1; the evictable counter, the leaf set and the block set match a recount.
        """
        bs = self.block_size
        seen_blocks: set[int] = set()
        leaves: set[RadixNode] = set()
        evictable = 0
        for ns, root in self._roots.items():
            _check(root.parent is None and root.alive, f"bad root for namespace {ns!r}: {root!r}")
            _check(not root.tokens and not root.block_ids, f"root of {ns!r} holds tokens or blocks")
            stack = [root]
            while stack:
                node = stack.pop()
                _check(node.lock_count >= 0, f"negative lock count: {node!r}")
                _check(node.namespace == ns, f"node in the wrong namespace: {node!r}")
                child_locks = 0
                for key, child in node.children.items():
                    _check(child.alive and child.parent is node, f"bad parent link: {child!r}")
                    _check(child.num_blocks >= 1, f"empty edge: {child!r}")
                    _check(len(child.tokens) == child.num_blocks * bs, f"edge not block-aligned: {child!r}")
                    _check(child.tokens[:bs] == key, f"child keyed by the wrong tokens: {child!r}")
                    _check(child.last_access <= node.last_access, f"child newer than parent: {child!r}")
                    child_locks += child.lock_count
                    stack.append(child)
                _check(node.lock_count >= child_locks, f"lock count below its children's: {node!r}")
                if node.is_root:
                    continue
                if not node.children:
                    leaves.add(node)
                if node.lock_count == 0:
                    evictable += node.num_blocks
                for b in node.block_ids:
                    _check(b not in seen_blocks, f"block {b} appears twice in the tree")
                    seen_blocks.add(b)
                    _check(self.pool.ref_count(b) >= 1, f"cached block {b} has ref count 0")
        _check(seen_blocks == self._tree_blocks, "block set differs from a recount")
        _check(leaves == self._leaves, "leaf set differs from a recount")
        _check(
            evictable == self._evictable_blocks,
            f"evictable counter {self._evictable_blocks} != recount {evictable}",
        )
        self.pool.check_integrity()

    # ------------------------------------------------------------------ internals

    def _root(self, namespace: Hashable) -> RadixNode:
        ns = _DEFAULT_NAMESPACE if namespace is None else namespace
        root = self._roots.get(ns)
        if root is None:
            root = RadixNode(next(self._node_ids), ns, (), [], None, self._clock)
            self._roots[ns] = root
        return root

    def _descend(self, root: RadixNode, key: tuple[int, ...]) -> tuple[RadixNode, list[int]]:
        """Walk the longest whole-block prefix of ``key`` from ``root``, splitting where it ends mid-edge.

        Returns the deepest node on the path (covering exactly the matched blocks) and the matched
        block ids. Stamps every node on the path with a fresh access time.
        """
        bs = self.block_size
        self._clock += 1
        now = self._clock
        node = root
        node.last_access = now
        block_ids: list[int] = []
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos : pos + bs])
            if child is None:
                break
            # The first block matched through the dict key; count how many more of the edge match.
            matched = 1
            while (
                matched < child.num_blocks
                and pos + (matched + 1) * bs <= len(key)
                and child.tokens[matched * bs : (matched + 1) * bs]
                == key[pos + matched * bs : pos + (matched + 1) * bs]
            ):
                matched += 1
            ends_inside_edge = matched < child.num_blocks
            if ends_inside_edge:
                child = self._split(child, matched)
            child.last_access = now
            block_ids.extend(child.block_ids)
            pos += matched * bs
            node = child
            if ends_inside_edge:
                break  # the key ran out or diverged inside the old edge
        return node, block_ids

    def _split(self, node: RadixNode, num_blocks: int) -> RadixNode:
        """Cut ``node``'s edge after ``num_blocks`` blocks; returns the new upper node.

        ``node`` keeps the lower part (and its children, locks and identity), so locks held on it by
        requests stay valid. The upper node inherits its lock count, since every lock on ``node`` or
        below also counts on each ancestor; the evictable counter does not change.
        """
        parent = node.parent
        assert parent is not None and 0 < num_blocks < node.num_blocks
        cut = num_blocks * self.block_size
        upper = RadixNode(
            node_id=next(self._node_ids),
            namespace=node.namespace,
            tokens=node.tokens[:cut],
            block_ids=node.block_ids[:num_blocks],
            parent=parent,
            last_access=node.last_access,
        )
        upper.lock_count = node.lock_count
        node.tokens = node.tokens[cut:]
        node.block_ids = node.block_ids[num_blocks:]
        parent.children[upper.tokens[: self.block_size]] = upper
        upper.children[node.tokens[: self.block_size]] = node
        node.parent = upper
        return upper

    def _attach(self, parent: RadixNode, child: RadixNode) -> None:
        parent.children[child.tokens[: self.block_size]] = child
        self._leaves.discard(parent)
        self._leaves.add(child)

    def _check_adoptable(self, blocks: list[int]) -> None:
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"insert got the same block twice: {blocks}")
        for b in blocks:
            if not 0 <= b < self.pool.num_blocks:
                raise ValueError(f"block id {b} is outside the pool")
            if b in self._tree_blocks:
                raise ValueError(f"block {b} is already cached under other tokens")
            if self.pool.ref_count(b) < 1:
                raise ValueError(f"block {b} is free; only blocks in use can be cached")

    def _remove_leaf(self, node: RadixNode) -> int:
        """Detach an unlocked leaf and drop the tree's references; returns how many blocks became free."""
        parent = node.parent
        assert parent is not None and not node.children and node.lock_count == 0
        del parent.children[node.tokens[: self.block_size]]
        self._leaves.discard(node)
        if not parent.is_root and not parent.children:
            self._leaves.add(parent)
        self._tree_blocks.difference_update(node.block_ids)
        self._evictable_blocks -= node.num_blocks
        node.alive = False
        self.version += 1
        if self.observer is not None:
            self.observer.on_removed(node)
        return self._release_blocks(node.block_ids)

    def _release_blocks(self, blocks: list[int]) -> int:
        self.pool.free(blocks)
        return sum(1 for b in blocks if self.pool.ref_count(b) == 0)

    def _prune_roots(self) -> None:
        # An empty, unlocked root is only bookkeeping; dropping it keeps one-off namespaces (a cache
        # salt per user, an old weight version) from piling up.
        for ns in [ns for ns, r in self._roots.items() if not r.children and r.lock_count == 0]:
            self._roots.pop(ns).alive = False


def _check(condition: bool, message: str) -> None:
    # An explicit raise, not `assert`, so integrity checks survive `python -O`.
    if not condition:
        raise AssertionError(message)
