"""The engine process's CPU priority: ``--engine-niceness`` (default 5 on CPUs, 0 elsewhere)."""

from __future__ import annotations

import argparse

import pytest

from tokenmill.config import EngineConfig, build_engine_config
from tokenmill.engine_args import CPU_ENGINE_NICENESS, add_engine_args, engine_kwargs


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
