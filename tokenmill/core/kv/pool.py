"""A pool of fixed-size KV blocks, known only by integer id.

The pool knows nothing of requests, tokens or tensors: it hands out block ids, counts references
and takes blocks back. Whoever holds a reference (a request's allocation, a radix-tree node) must
give it back exactly once with :meth:`BlockPool.free`.
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than the pool has free."""


class BlockPool:
    """Integer block ids with a free list and reference counts.

    Contract: ``allocate`` returns blocks with a reference count of one; ``incref`` adds a holder to
    blocks already in use; ``free`` drops one holder from each block and returns a block to the free
    list when its last holder lets go. A free block is never referenced and a referenced block is
    never on the free list (``check_integrity`` asserts both).

    The free list is a stack: the block freed last is handed out first (lowest ids first at start).
    Its memory was touched recently, so it is still mapped and likely still in cache; a queue would
    cycle through the whole pool, and on CPU every block's first use faults in fresh pages.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks - 1, -1, -1))  # top of the stack: the right end

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.num_used / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with one reference. Raises NoFreeBlocksError if short."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        """Add one holder to each block; every block must already be in use."""
        for b in blocks:
            if self._ref_counts[b] <= 0:
                raise ValueError(f"incref of free block {b}")
            self._ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one holder from each block; blocks whose count reaches zero become free."""
        # Pushed last to first, so a later allocation gets them back in their original order.
        for b in reversed(blocks):
            count = self._ref_counts[b]
            if count <= 0:
                raise ValueError(f"double free of block {b}")
            self._ref_counts[b] = count - 1
            if count == 1:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def check_integrity(self) -> None:
        """Assert the pool's invariants: counts non-negative, free list == blocks with count zero."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        for b, count in enumerate(self._ref_counts):
            if count < 0:
                raise AssertionError(f"block {b} has negative ref count {count}")
            if (count == 0) != (b in free):
                raise AssertionError(f"block {b}: ref count {count} but free={b in free}")
