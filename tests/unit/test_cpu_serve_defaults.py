"""`tokenmill serve`'s defaults that differ on CPUs: the engine process's CPU priority
(``--engine-niceness``, 5) and short prefills cutting decode steps (``--short-prefill-interrupt``,
256 tokens); 0 on accelerators and in the Python API."""

from __future__ import annotations

import argparse

import pytest

from tokenmill.config import EngineConfig, SchedulerConfig, build_engine_config
from tokenmill.engine_args import (
    CPU_ENGINE_NICENESS,
    CPU_SHORT_PREFILL_INTERRUPT,
    add_engine_args,
    engine_kwargs,
)


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
