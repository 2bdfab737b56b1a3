"""The engine process's environment: OpenMP threads sleep at barriers unless the user chose."""

from __future__ import annotations

from tokenmill.server.engine_process import engine_environment


def test_engine_threads_sleep_by_default() -> None:
    environment = engine_environment({"PATH": "/usr/bin"})
    assert environment == {"PATH": "/usr/bin", "OMP_WAIT_POLICY": "PASSIVE"}


def test_a_chosen_wait_policy_is_kept() -> None:
    assert engine_environment({"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"
