"""The worker's half of the sliding-window KV group (``core/kv/window_group.py``).

For a model that mixes full and sliding-window layers and opts in (``CausalLM.window_kv_group``), the
sliding layers keep their keys and values in a pool of their own: their cache tensors have
``num_window_blocks`` blocks, the full layers' have ``num_full_blocks``, and each step's entries
carry the window group's table (``ScheduledRequest.window_block_table``). The sliding layers'
attention metadata is built from that table (its own slot mapping); the full layers' from the
request's ``block_table`` as for any model.

Sizing: the window pool holds ``max_num_seqs`` requests of ``cdiv(window, block_size) + 1`` blocks plus
one step's tokens, and at least one whole context (a prompt stays whole until computed, for the
prefix cache), never more than the full pool. When the pool's size comes from memory (no explicit
``num_blocks``), the memory the sliding layers do not need goes to the full pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig
from tokenmill.core.step_io import ScheduledRequest
from tokenmill.layers.attention.backend import AttentionBackend, SequenceStep
from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.worker.kv_cache import allocate_kv_caches, bytes_per_block


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class WindowKVGroup:
    """Which layers form the window group, its window, and both pools' sizes in blocks."""

    window: int
    window_layers: frozenset[int]
    num_layers: int
    num_full_blocks: int
    num_window_blocks: int

    @classmethod
    def plan(
        cls,
        layer_windows: Sequence[int | None],
        opted_in: bool,
        config: EngineConfig,
        num_blocks: int,
        context_tokens: int,
    ) -> WindowKVGroup | None:
        """The group for a model whose layers have ``layer_windows`` and a pool of ``num_blocks``
        (what every layer would get), or None: the model did not opt in, its layers are all full or
        all windowed (then the one pool serves, releasing blocks if every layer is windowed), or its
        windowed layers differ in window."""
        windows = [w for w in layer_windows if w is not None]
        if not opted_in or not windows or len(windows) == len(layer_windows) or len(set(windows)) > 1:
            return None
        window, bs = max(windows), config.cache.block_size
        scheduler = config.scheduler
        need = scheduler.max_num_seqs * (_cdiv(window, bs) + 1) + _cdiv(scheduler.max_num_batched_tokens, bs)
        num_window_blocks = min(num_blocks, max(need, _cdiv(context_tokens, bs) + 1))
        num_full_blocks = num_blocks
        layers = frozenset(i for i, w in enumerate(layer_windows) if w is not None)
        if not config.cache.num_blocks:  # sized from memory: the sliding layers' spare goes to the rest
            num_full = len(layer_windows) - len(layers)
            num_full_blocks += (num_blocks - num_window_blocks) * len(layers) // num_full
        return cls(window, layers, len(layer_windows), num_full_blocks, num_window_blocks)

    def allocate(
        self,
        *,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        num_planes: int,
        num_layers: int,
    ) -> list[torch.Tensor]:
        """One cache tensor per layer: ``num_window_blocks`` blocks for the window layers,
        ``num_full_blocks`` for the others (same arguments as ``allocate_kv_caches``)."""
        shape = {"block_size": block_size, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
        shape["num_planes"] = num_planes
        num_window = len(self.window_layers)
        window = iter(
            allocate_kv_caches(
                self.num_window_blocks, num_layers=num_window, dtype=dtype, device=device, **shape
            )
        )
        full = iter(
            allocate_kv_caches(
                self.num_full_blocks, num_layers=num_layers - num_window, dtype=dtype, device=device, **shape
            )
        )
        return [next(window) if i in self.window_layers else next(full) for i in range(num_layers)]

    def cache_bytes(
        self, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, num_planes: int
    ) -> int:
        """The bytes of both pools."""
        num_window = len(self.window_layers)
        per_layer_block = bytes_per_block(1, block_size, num_kv_heads, head_dim, dtype, num_planes)
        return per_layer_block * (
            num_window * self.num_window_blocks + (self.num_layers - num_window) * self.num_full_blocks
        )

    def full_layer_caches(self, caches: list[torch.Tensor]) -> list[torch.Tensor]:
        """The full layers' tensors of ``caches`` (those the request's ``block_table`` indexes)."""
        return [c for i, c in enumerate(caches) if i not in self.window_layers]

    def build_metadata(
        self,
        backend: type[AttentionBackend],
        entries: Sequence[ScheduledRequest],
        offsets: Sequence[int],
        block_size: int,
        device: torch.device,
    ) -> dict[int | None, AttentionMetadata]:
        """The window layers' metadata for the step, from each entry's ``window_block_table``."""
        bs = block_size
        slots: list[int] = []
        sequences: list[SequenceStep] = []
        for entry, offset in zip(entries, offsets):
            table = entry.window_block_table
            if table is None:
                raise RuntimeError(f"request {entry.request_id!r} has no sliding-window block table")
            start, n = entry.start_position, len(entry.token_ids)
            sequences.append(SequenceStep(offset, start, n, table))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)  # [num_tokens]
        return backend.build_metadata(sequences, slot_mapping, bs, [self.window])
