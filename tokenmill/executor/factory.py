"""Builds the executor ``EngineConfig.executor_backend`` names."""

from __future__ import annotations

from tokenmill.config import EXECUTOR_BACKENDS, EngineConfig
from tokenmill.executor.base import Executor
from tokenmill.loader import ModelSource


def make_executor(config: EngineConfig, source: ModelSource) -> Executor:
    """``inprocess``: the runner in this process; ``mp``: the runner in one child process
    (``executor/multiproc.py``). Imported lazily: each pulls in what only it needs."""
    if config.executor_backend == "inprocess":
        from tokenmill.executor.inprocess import InProcessExecutor

        return InProcessExecutor(config, source)
    if config.executor_backend == "mp":
        from tokenmill.executor.multiproc import MultiProcessExecutor

        return MultiProcessExecutor(config, source)
    raise ValueError(f"executor_backend must be one of {EXECUTOR_BACKENDS}, got {config.executor_backend!r}")
