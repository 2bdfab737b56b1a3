"""`tokenmill serve`'s defaults that differ on CPUs: the engine process's CPU priority
(``--engine-niceness``, 5), short prefills cutting decode steps (``--short-prefill-interrupt``,
256 tokens) and the KV cache's pages mapped ahead of use while the engine is idle
(``--kv-prefault``); off on accelerators and in the Python API. And what the prefaulter does to the
cache's memory map."""

from __future__ import annotations

import argparse
import ctypes
import mmap

import pytest
import torch

from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig, build_engine_config
from tokenmill.engine_args import (
    CPU_ENGINE_NICENESS,
    CPU_SHORT_PREFILL_INTERRUPT,
    add_engine_args,
    engine_kwargs,
)
from tokenmill.worker.kv_cache import IdlePrefaulter, allocate_kv_caches


def engine_config(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return build_engine_config("m", **engine_kwargs(parser.parse_args(list(argv))))


def test_cpu_servers_lower_the_engines_priority_by_default() -> None:
    assert EngineConfig().engine_niceness == 0  # the Python API: nothing changes
    assert engine_config().engine_niceness == CPU_ENGINE_NICENESS == 5
    assert engine_config("--device", "cuda").engine_niceness == 0
    assert engine_config("--engine-niceness", "0").engine_niceness == 0
    assert engine_config("--device", "cuda:1", "--engine-niceness", "3").engine_niceness == 3


@pytest.mark.parametrize("niceness", [-1, 20])
def test_niceness_outside_0_to_19_is_refused(niceness: int) -> None:
    with pytest.raises(ValueError, match=f"engine_niceness must be within 0..19, got {niceness}"):
        EngineConfig(engine_niceness=niceness).validate()


def test_short_prefills_cut_steps_by_default_on_cpus_in_servers_only() -> None:
    assert SchedulerConfig().short_prefill_interrupt == 0 and not SchedulerConfig().cuts_steps()

    def scheduler(*argv: str) -> SchedulerConfig:
        return engine_config(*argv).scheduler

    assert scheduler().short_prefill_interrupt == CPU_SHORT_PREFILL_INTERRUPT == 256
    assert scheduler().cuts_steps()
    assert scheduler("--device", "cuda:0").short_prefill_interrupt == 0
    assert scheduler("--device", "cuda", "--short-prefill-interrupt", "64").short_prefill_interrupt == 64
    off = scheduler("--short-prefill-interrupt", "0")
    assert off.short_prefill_interrupt == 0 and not off.cuts_steps()
    assert scheduler("--short-prefill-interrupt", "0", "--tier-slo", "priority:ttft=0.5").cuts_steps()
    with pytest.raises(ValueError, match="short_prefill_interrupt must be >= 0 tokens, got -1"):
        SchedulerConfig(short_prefill_interrupt=-1).validate()


def test_cpu_servers_map_the_kv_cache_at_start_up_by_default() -> None:
    assert not CacheConfig().prefault  # the Python API: pages are mapped as blocks are first written
    assert engine_config().cache.prefault
    assert not engine_config("--no-kv-prefault").cache.prefault
    assert not engine_config("--device", "cuda").cache.prefault
    assert engine_config("--device", "cuda", "--kv-prefault").cache.prefault


def resident_kib(address: int, size: int) -> int:
    """KiB of ``[address, address + size)`` in memory now (``mincore``; the kernel may merge the map
    with a neighbouring one, so the mapping's own totals in ``/proc/self/smaps`` can count others')."""
    page = mmap.PAGESIZE
    num_pages = -(-size // page)
    in_core = (ctypes.c_ubyte * num_pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), in_core) == 0, ctypes.get_errno()
    return sum(flag & 1 for flag in in_core) * page // 1024


def test_the_idle_prefaulter_maps_the_cache_block_by_block_and_changes_no_contents() -> None:
    caches = allocate_kv_caches(
        512,
        num_layers=4,
        block_size=16,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    size = 4 * 2 * 512 * 16 * 2 * 64 * 2  # 16 MiB, the layers one after another
    size_kib = size // 1024
    address = caches[0].data_ptr()
    assert resident_kib(address, size) == 0  # nothing written yet: no page is mapped
    caches[2][1, 300].fill_(1.5)  # a block written before its turn (values of layer 2)
    prefaulter = IdlePrefaulter(caches, blocks_per_step=128)
    assert prefaulter.step() and not prefaulter.done  # blocks 0-127 of every layer
    assert size_kib // 4 <= resident_kib(address, size) < size_kib // 2
    assert prefaulter.step() and prefaulter.step()
    assert not prefaulter.step() and prefaulter.done  # the last 128
    assert resident_kib(address, size) == size_kib
    assert not prefaulter.step()  # nothing left to do
    assert bool((caches[2][1, 300] == 1.5).all())
    caches[2][1, 300].zero_()
    assert all(not cache.any() for cache in caches)  # every other value still zero
