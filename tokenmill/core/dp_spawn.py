"""Starting the engine processes of a server: one, or ``data_parallel_size`` replicas.

Each replica is a whole engine process (``core/engine_proc.py``) with its own weights and KV cache.
``replica_config`` shares the machine out between them: on a CPU each gets ``num_threads`` (or, by
default, an equal share of the cores this process may use, at least one), and a KV budget given as
a fraction of memory (``kv_cache_memory`` as a float, and the default ``kv_cache_memory_fraction``)
is divided by the number of replicas, so that N replicas never ask for N times the memory. A byte
budget and ``num_blocks`` are per replica. A replica's own config has ``data_parallel_size`` 1.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

from tokenmill.config import DataParallelConfig, EngineConfig
from tokenmill.core.engine_proc import (
    EngineProcessHandle,
    make_socket_dir,
    spawn_engine_process,
    stop_engine_process,
)


def available_cpus() -> int:
    """How many CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def replica_config(config: EngineConfig) -> EngineConfig:
    """The config each of ``config``'s data-parallel replicas runs with (``config`` itself when
    there is one)."""
    size = config.data_parallel.data_parallel_size
    if size == 1:
        return config
    cache = config.cache
    memory = cache.kv_cache_memory
    if isinstance(memory, float):
        memory = memory / size
    threads = config.num_threads
    if threads is None and config.model.device == "cpu":
        threads = max(1, available_cpus() // size)
    return dataclasses.replace(
        config,
        cache=dataclasses.replace(
            cache, kv_cache_memory=memory, kv_cache_memory_fraction=cache.kv_cache_memory_fraction / size
        ),
        num_threads=threads,
        # A replica reports its cache's changes to the frontend's prefix index (cache_aware).
        data_parallel=DataParallelConfig(publish_kv_events=config.data_parallel.dp_policy == "cache_aware"),
    )


def spawn_engines(config: EngineConfig, log_level: str = "INFO") -> list[EngineProcessHandle]:
    """Start every engine process ``config`` asks for (``data_parallel_size`` of them), each in its
    own ``make_socket_dir()`` folder; ``AsyncLLM.start(spawned=...)`` attaches to them."""
    if config.data_parallel.data_parallel_backend == "ray" and config.data_parallel.data_parallel_size > 1:
        return []  # Ray actors, placed when the server starts (core/dp_ray.py)
    replica = replica_config(config)
    handles: list[EngineProcessHandle] = []
    try:
        for _ in range(config.data_parallel.data_parallel_size):
            handles.append(spawn_engine_process(replica, make_socket_dir(), log_level))
    except BaseException:
        stop_engines(handles)
        raise
    return handles


def stop_engines(handles: list[EngineProcessHandle]) -> None:
    """Stop engine processes started by ``spawn_engines`` that no client took, and remove their
    socket folders."""
    for handle in handles:
        stop_engine_process(handle.process)
        shutil.rmtree(handle.socket_dir, ignore_errors=True)
