"""Data-parallel configuration: the serve options, validation, what each replica gets
(``core/dp_spawn.py``), and ``LLM`` refusing it."""

from __future__ import annotations

import argparse

import pytest

from tokenmill import LLM
from tokenmill.config import build_engine_config
from tokenmill.core.dp_spawn import available_cpus, replica_config
from tokenmill.server.cli_args import add_serve_args, engine_config_from_args


def serve_config(*argv: str):  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return engine_config_from_args(parser.parse_args(["tiny", *argv]))


def test_serve_options_reach_the_config() -> None:
    config = serve_config(
        "--data-parallel-size",
        "2",
        "--dp-policy",
        "least_load",
        "--dp-balance-abs",
        "3",
        "--dp-balance-rel",
        "2",
        "--data-parallel-backend",
        "ray",
    )
    dp = config.data_parallel
    assert dp.data_parallel_backend == "ray"
    assert serve_config().data_parallel.data_parallel_backend == "mp"
    assert (dp.data_parallel_size, dp.dp_policy, dp.dp_balance_abs, dp.dp_balance_rel) == (
        2,
        "least_load",
        3,
        2.0,
    )
    assert serve_config().data_parallel.data_parallel_size == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"data_parallel_size": 0}, "data_parallel_size must be >= 1"),
        ({"dp_policy": "random"}, "dp_policy must be one of cache_aware, round_robin, least_load"),
        ({"dp_balance_abs": -1}, "dp_balance_abs must be >= 0"),
        ({"dp_balance_rel": 0.9}, "dp_balance_rel must be >= 1.0"),
        ({"data_parallel_backend": "k8s"}, "data_parallel_backend must be one of mp, ray, got 'k8s'"),
    ],
)
def test_bad_values_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_engine_config("m", **kwargs).validate()  # type: ignore[arg-type]


def test_each_replica_gets_its_share_of_cores_and_memory() -> None:
    config = build_engine_config("m", data_parallel_size=2, kv_cache_memory=0.5)
    replica = replica_config(config)
    assert replica.num_threads == max(1, available_cpus() // 2)
    assert replica.cache.kv_cache_memory == 0.25
    assert replica.cache.kv_cache_memory_fraction == config.cache.kv_cache_memory_fraction / 2
    assert replica.data_parallel.data_parallel_size == 1
    # cache_aware (the default) reads the replicas' cache events; other policies need none.
    assert replica.data_parallel.publish_kv_events
    assert not replica_config(
        build_engine_config("m", data_parallel_size=2, dp_policy="round_robin")
    ).data_parallel.publish_kv_events
    replica.validate()
    # Bytes, blocks and explicit threads are per replica.
    explicit = build_engine_config(
        "m", data_parallel_size=2, kv_cache_memory=10**8, num_blocks=64, num_threads=3
    )
    replica = replica_config(explicit)
    assert (replica.cache.kv_cache_memory, replica.cache.num_blocks, replica.num_threads) == (10**8, 64, 3)
    single = build_engine_config("m")
    assert replica_config(single) is single


def test_llm_refuses_data_parallelism() -> None:
    with pytest.raises(ValueError, match="data_parallel_size > 1 needs `tokenmill serve`"):
        LLM("smollm2-135m", data_parallel_size=2)


def test_ray_replicas_are_not_spawned_as_processes() -> None:
    from tokenmill.core.dp_spawn import spawn_engines

    config = build_engine_config("m", data_parallel_size=2, data_parallel_backend="ray")
    assert spawn_engines(config) == []  # placed as Ray actors when the server starts (core/dp_ray.py)
