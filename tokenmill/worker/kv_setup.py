"""The model runner's KV cache set-up: how many blocks the pool gets, what they cost, the sliding
window group, the zeroed tensors and the idle prefaulter (``ModelRunner.__init__`` calls these once;
``ModelRunner.resume_memory`` allocates again through ``new_kv_caches``).

Nothing here keeps state: every function reads the config, the model's ``kv_cache_spec`` and the
device, and returns what the runner keeps.
"""

from __future__ import annotations

import logging

import torch

from tokenmill.config import EngineConfig
from tokenmill.loader import ModelSource
from tokenmill.models.base import CausalLM
from tokenmill.worker.kv_cache import (
    IdlePrefaulter,
    allocate_kv_caches,
    bytes_per_block,
    default_num_blocks,
    num_blocks_for_budget,
)
from tokenmill.worker.kv_groups import WindowKVGroup
from tokenmill.worker.state_cache import StateCache

logger = logging.getLogger(__name__)

# How far the idle prefaulter maps ahead of the highest KV block written, in steps of the full token
# budget: enough that a burst of new prompts rarely faults, small enough that idle memory stays low.
PREFAULT_AHEAD_STEPS = 2


def context_tokens(config: EngineConfig, source: ModelSource) -> int:
    """The context window as the engine core will set it (before the pool caps it)."""
    model_limit = int(getattr(source.hf_config, "max_position_embeddings", 0) or 0) or 2048
    return min(config.model.max_model_len or model_limit, model_limit)


def kv_shape(model: CausalLM, block_size: int) -> dict[str, int]:
    """The cache's shape as ``worker/kv_cache.py`` takes it, from the model's ``kv_cache_spec``."""
    spec = model.kv_cache_spec
    return {
        "num_layers": model.num_layers,
        "block_size": block_size,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "num_planes": spec.num_planes,
    }


def kv_bytes_per_block(model: CausalLM, block_size: int, kv_dtype: torch.dtype) -> int:
    """One block's bytes over all of the model's layers (``worker/kv_cache.bytes_per_block``)."""
    spec = model.kv_cache_spec
    return bytes_per_block(
        model.num_layers, block_size, spec.num_kv_heads, spec.head_dim, kv_dtype, spec.num_planes
    )


def kv_pool_blocks(
    config: EngineConfig,
    source: ModelSource,
    model: CausalLM,
    device: torch.device,
    kv_dtype: torch.dtype,
    state_cache: StateCache | None,
) -> int:
    """The pool's size: ``num_blocks``, else ``kv_cache_memory`` (bytes or a fraction), else
    what ``max_num_seqs`` sequences of the whole context window need, capped at
    ``kv_cache_memory_fraction`` of the available memory (``default_num_blocks``); a recurrent
    model's ``state_cache`` comes out of the same budget."""
    cache = config.cache
    if cache.num_blocks:
        return cache.num_blocks
    shape = kv_shape(model, cache.block_size)
    if cache.kv_cache_memory is not None:
        num_blocks = num_blocks_for_budget(cache.kv_cache_memory, device, dtype=kv_dtype, **shape)
    else:
        num_blocks = default_num_blocks(
            config.scheduler.max_num_seqs * context_tokens(config, source),
            cache.kv_cache_memory_fraction,
            device,
            dtype=kv_dtype,
            **shape,
        )
    if state_cache is None:
        return num_blocks
    per_block = kv_bytes_per_block(model, cache.block_size, kv_dtype)
    return max(1, num_blocks - -(-state_cache.total_bytes // per_block))


def plan_kv_pool(
    config: EngineConfig,
    source: ModelSource,
    model: CausalLM,
    device: torch.device,
    kv_dtype: torch.dtype,
    state_cache: StateCache | None,
) -> tuple[int, int, WindowKVGroup | None]:
    """``(num_blocks, kv_cache_bytes, window_group)``: the full-attention pool's blocks, the bytes
    of all KV tensors, and the sliding-window layers' pool of their own (``worker/kv_groups.py``)
    when the model opts in (else None)."""
    block_size = config.cache.block_size
    num_blocks = kv_pool_blocks(config, source, model, device, kv_dtype, state_cache)
    spec = model.kv_cache_spec
    kv_cache_bytes = num_blocks * kv_bytes_per_block(model, block_size, kv_dtype)
    window_group = WindowKVGroup.plan(
        model.layer_sliding_windows,
        model.window_kv_group,
        config,
        num_blocks,
        context_tokens(config, source),
    )
    if window_group is not None:
        num_blocks = window_group.num_full_blocks
        kv_cache_bytes = window_group.cache_bytes(
            block_size, spec.num_kv_heads, spec.head_dim, kv_dtype, spec.num_planes
        )
    return num_blocks, kv_cache_bytes, window_group


def new_kv_caches(
    model: CausalLM,
    block_size: int,
    num_blocks: int,
    window_group: WindowKVGroup | None,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """Zeroed cache tensors: one pool for all layers, or the window group's two."""
    shape = kv_shape(model, block_size)
    if window_group is not None:
        return window_group.allocate(dtype=dtype, device=device, **shape)
    return allocate_kv_caches(num_blocks, dtype=dtype, device=device, **shape)


def make_prefaulter(
    config: EngineConfig,
    device: torch.device,
    kv_caches: list[torch.Tensor],
    window_group: WindowKVGroup | None,
) -> IdlePrefaulter | None:
    """What maps the cache's pages ahead of use while the engine is idle (``CacheConfig.prefault``,
    CPU only; else None), a few steps' worth of blocks beyond the highest one written: resident
    memory follows use."""
    if not (config.cache.prefault and device.type == "cpu"):
        return None
    ahead_tokens = PREFAULT_AHEAD_STEPS * config.scheduler.max_num_batched_tokens
    return IdlePrefaulter(
        kv_caches if window_group is None else window_group.full_layer_caches(kv_caches),
        ahead_blocks=-(-ahead_tokens // config.cache.block_size),
    )


def log_kv_cache(num_blocks: int, block_size: int, kv_cache_bytes: int, kv_dtype: torch.dtype) -> None:
    """One log line with the pool's size in tokens, blocks and bytes."""
    logger.info(
        "KV cache: %d tokens (%d blocks of %d), %.2f GB of %s",
        num_blocks * block_size,
        num_blocks,
        block_size,
        kv_cache_bytes / 1e9,
        str(kv_dtype).removeprefix("torch."),
    )
