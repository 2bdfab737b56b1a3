"""The KV pool's default size (what the scheduler can use, capped by a fraction of available memory),
``--kv-cache-memory`` in bytes beside the fraction, the size reported to the frontend, and lazy
prefaulting (resident memory follows the blocks written, not the whole pool)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest
import torch
from test_cpu_serve_defaults import resident_kib

from tests.conftest import TinyModel
from tokenmill.config import EngineConfig, build_engine_config
from tokenmill.engine_args import add_engine_args, engine_kwargs
from tokenmill.llm import LLM
from tokenmill.worker.kv_cache import (
    IdlePrefaulter,
    allocate_kv_caches,
    available_memory_bytes,
    bytes_per_block,
    default_num_blocks,
)

CPU = torch.device("cpu")
SHAPE = {"num_layers": 2, "block_size": 16, "num_kv_heads": 2, "head_dim": 64, "dtype": torch.float32}
BLOCK_BYTES = bytes_per_block(2, 16, 2, 64, torch.float32)  # 16 KiB


def engine_config(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return build_engine_config("m", **engine_kwargs(parser.parse_args(list(argv))))


@pytest.mark.parametrize(
    ("argument", "expected"),
    [("4G", 4 * 2**30), ("512MiB", 512 * 2**20), ("2000000000", 2_000_000_000), ("0.3", 0.3)],
)
def test_kv_cache_memory_takes_bytes_or_a_fraction(argument: str, expected: float) -> None:
    assert engine_config("--kv-cache-memory", argument).cache.kv_cache_memory == expected


def test_the_default_is_sized_from_the_scheduler_and_capped_by_the_fraction() -> None:
    config = engine_config()
    assert config.cache.kv_cache_memory is None and config.cache.kv_cache_memory_fraction == 0.25
    assert engine_config("--kv-cache-memory-fraction", "0.1").cache.kv_cache_memory_fraction == 0.1
    with pytest.raises(ValueError, match="kv_cache_memory_fraction must be in"):
        engine_config("--kv-cache-memory-fraction", "1.5").validate()
    # 8 sequences of 100 tokens need 7 blocks each: 50 blocks (ceil(800 / 16)).
    assert default_num_blocks(8 * 100, 0.25, CPU, **SHAPE) == 50
    # A wish larger than the cap gets the cap.
    cap = int(available_memory_bytes(CPU) * 0.01) // BLOCK_BYTES
    assert abs(default_num_blocks(10**12, 0.01, CPU, **SHAPE) - cap) <= cap // 100 + 1


def test_the_engine_reports_the_pool_it_sized(tiny_model: Callable[[str], TinyModel]) -> None:
    llm = LLM(tiny_model("llama").path, dtype="float32", max_model_len=64, max_num_seqs=4, block_size=4)
    stats = llm.engine.kv_stats()
    assert stats["kv_cache_tokens"] == 4 * 64  # max_num_seqs × max_model_len, no more
    runner = llm.engine.executor.runner  # type: ignore[attr-defined]
    per_block = bytes_per_block(
        runner.model.num_layers, 4, runner.model.num_kv_heads, runner.model.head_dim, torch.float32
    )
    assert stats["kv_cache_bytes"] == 64 * per_block
    assert llm.engine.max_model_len == 64  # the pool still holds a whole context window


def test_the_lazy_prefaulter_maps_only_a_window_beyond_what_was_written() -> None:
    caches = allocate_kv_caches(512, device=CPU, **{**SHAPE, "dtype": torch.bfloat16})
    size = 2 * 2 * 512 * 16 * 2 * 64 * 2  # 8 MiB, the layers one after another
    address = caches[0].data_ptr()
    prefaulter = IdlePrefaulter(caches, blocks_per_step=16, ahead_blocks=32)
    while prefaulter.step():
        pass
    first = resident_kib(address, size)
    assert 0 < first <= size // 1024 * 33 // 512  # about 32 blocks of 512 (plus a page)
    prefaulter.note_written(200)  # a step wrote block 200: map up to block 232
    assert prefaulter.step()
    while prefaulter.step():
        pass
    assert not prefaulter.done
    second = resident_kib(address, size)
    assert size // 1024 * 232 // 512 <= second <= size // 1024 * 234 // 512
