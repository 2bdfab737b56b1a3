"""Sizing and allocating the paged KV cache tensors."""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import sys
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def available_memory_bytes(device: torch.device) -> int:
    """Memory a new allocation could use now: free GPU memory, or MemAvailable on a CPU host."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def bytes_per_block(
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    num_planes: int = 2,
) -> int:
    """Bytes of one block over every layer; ``num_planes`` is 2 for separate keys and values, 1 for
    one latent tensor (``models/base.py`` ``KVCacheSpec``)."""
    element = torch.empty((), dtype=dtype).element_size()
    return num_planes * num_layers * block_size * num_kv_heads * head_dim * element


def default_num_blocks(
    wanted_tokens: int,
    fraction_cap: float,
    device: torch.device,
    *,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    num_planes: int = 2,
) -> int:
    """The default pool: the blocks ``wanted_tokens`` need (``max_num_seqs × max_model_len``: every
    sequence the scheduler may run at its longest), capped at ``fraction_cap`` of the memory
    available now, so a small model with a short context does not reserve a quarter of the machine."""
    wanted_blocks = max(1, -(-wanted_tokens // block_size))
    cap_blocks = num_blocks_for_budget(
        fraction_cap,
        device,
        num_layers=num_layers,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        num_planes=num_planes,
    )
    return min(wanted_blocks, cap_blocks)


def num_blocks_for_budget(
    budget: int | float,
    device: torch.device,
    *,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    num_planes: int = 2,
) -> int:
    """How many blocks fit in ``budget``: bytes when an int, a fraction of free memory when a float."""
    if isinstance(budget, float):
        budget_bytes = int(available_memory_bytes(device) * budget)
    else:
        budget_bytes = budget
    per_block = bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype, num_planes)
    num_blocks = budget_bytes // per_block
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory of {budget_bytes} bytes holds no block; one block needs {per_block} bytes"
        )
    return int(num_blocks)


def allocate_kv_caches(
    num_blocks: int,
    *,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    num_planes: int = 2,
) -> list[torch.Tensor]:
    """One ``[num_planes, num_blocks, block_size, kv_heads, head_dim]`` tensor per layer, zero-filled
    (planes: keys and values, or one latent plane for multi-head latent attention).

    On CPU the tensors are views of one anonymous memory map: the kernel hands out zero pages on first
    touch, so start-up does not spend seconds writing zeros over gigabytes, and resident memory grows
    with the blocks actually used; ``IdlePrefaulter`` maps them ahead of use while the engine is idle.
    """
    shape = (num_planes, num_blocks, block_size, num_kv_heads, head_dim)
    if device.type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    per_layer = math.prod(shape)
    element_size = torch.empty((), dtype=dtype).element_size()
    memory = mmap.mmap(
        -1, max(num_layers * per_layer * element_size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    )
    # No MADV_HUGEPAGE: 2 MiB pages made warm attention ~7% faster, but each block's first write
    # then faults a whole huge page, with direct compaction where the kernel's defrag setting is
    # "madvise" (the default): 0.75-2.4 ms per 2 MiB on the benchmark VM against 0.37 ms in 4 KiB
    # pages. The prefix cache keeps computed blocks, so new work lands on untouched memory until the
    # pool is full: offline throughput was 3% and the shared-prefix mean TTFT 8% better without.
    flat = torch.frombuffer(memory, dtype=dtype, count=num_layers * per_layer)  # keeps `memory` alive
    return [flat[i * per_layer : (i + 1) * per_layer].view(shape) for i in range(num_layers)]


# madvise(2) advice that maps a range's pages as a write would, leaving their contents as they are
# (Linux 5.14 and later).
MADV_POPULATE_WRITE = 23


class IdlePrefaulter:
    """Maps the pages of CPU KV cache tensors ahead of use, a few blocks a call, while the engine is
    idle (``CacheConfig.prefault``).

    The kernel maps an anonymous page on its first write, and on a VM that costs microseconds a page
    (the host backs it too): a block of SmolLM2's cache spans 90 pages, so a prefill over a cached
    prefix that starts 5 new blocks spent ~3 ms of its ~33 in faults, in ``write_kv`` on one thread
    while the other waited. Blocks are mapped in the order the pool hands out fresh ones (lowest ids
    first; freed blocks are reused before fresh ones), each across every layer's keys and values.
    ``MADV_POPULATE_WRITE`` leaves contents as they are, so blocks already written before their turn
    are unaffected.

    Lazily: with ``ahead_blocks``, only that many blocks beyond the highest one written so far
    (``note_written``) are mapped, so an idle server's resident memory stays near what it has used
    instead of growing to the whole pool; None maps the whole pool.

    Contract: ``step`` maps the next ``blocks_per_step`` blocks (within the lazy limit) and returns
    whether blocks remain to map now; after a failure (a kernel without the advice, not Linux) it
    logs why once and returns False from then on.
    """

    def __init__(
        self, caches: list[torch.Tensor], blocks_per_step: int = 8, ahead_blocks: int | None = None
    ) -> None:
        self._caches = caches  # each [num_planes, num_blocks, block_size, kv_heads, head_dim]
        self._num_blocks = caches[0].shape[1] if caches else 0
        self._block_bytes = caches[0][0, 0].numel() * caches[0].element_size() if caches else 0
        self._blocks_per_step = blocks_per_step
        self._ahead_blocks = ahead_blocks
        self._written_blocks = 0  # one past the highest block id written so far
        self._next_block = 0
        self._madvise = _libc_madvise()
        if self._madvise is None:
            logger.info("KV cache pages are mapped on first write: madvise is not available here")
            self._next_block = self._num_blocks

    @property
    def done(self) -> bool:
        """Every block of the pool is mapped."""
        return self._next_block >= self._num_blocks

    @property
    def _limit(self) -> int:
        if self._ahead_blocks is None:
            return self._num_blocks
        return min(self._num_blocks, self._written_blocks + self._ahead_blocks)

    def note_written(self, block_id: int) -> None:
        """A step writes KV into ``block_id`` (the lazy limit follows the highest one)."""
        self._written_blocks = max(self._written_blocks, block_id + 1)

    def step(self) -> bool:
        if self._next_block >= self._limit or self._madvise is None:
            return False
        first = self._next_block
        last = min(self._limit, first + self._blocks_per_step)
        page = mmap.PAGESIZE
        for cache in self._caches:
            for half in cache.unbind(0):  # keys and values, or the one latent plane
                start = half.data_ptr() + first * self._block_bytes
                end = half.data_ptr() + last * self._block_bytes
                aligned = start - start % page
                if self._madvise(
                    ctypes.c_void_p(aligned), ctypes.c_size_t(end - aligned), MADV_POPULATE_WRITE
                ):
                    logger.info(
                        "KV cache pages are mapped on first write: madvise(MADV_POPULATE_WRITE) failed (%s)",
                        os.strerror(ctypes.get_errno()),
                    )
                    self._next_block = self._num_blocks
                    return False
        self._next_block = last
        return self._next_block < self._limit


def _libc_madvise() -> Callable[..., int] | None:
    """libc's ``madvise`` (errno kept), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    madvise: Callable[..., int] = ctypes.CDLL(None, use_errno=True).madvise
    return madvise
