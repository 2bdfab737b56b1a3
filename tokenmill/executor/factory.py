"""Builds the executor ``EngineConfig.executor_backend`` names."""

from __future__ import annotations

from tokenmill.config import EXECUTOR_BACKENDS, EngineConfig
from tokenmill.executor.base import Executor
from tokenmill.loader import ModelSource


def make_executor(config: EngineConfig, source: ModelSource) -> Executor:
    """``inprocess``: the runner in this process; ``mp``, or any ``tensor_parallel_size > 1``: the
    runner in child processes (``executor/multiproc.py``, one per rank), or in Ray actors when
    ``distributed_executor_backend`` is ``ray`` (``executor/ray_executor.py``). Imported lazily:
    each pulls in what only it needs."""
    if config.executor_backend == "inprocess" and config.tensor_parallel_size == 1:
        from tokenmill.executor.inprocess import InProcessExecutor

        return InProcessExecutor(config, source)
    if config.executor_backend in EXECUTOR_BACKENDS and config.distributed_executor_backend == "ray":
        from tokenmill.executor.ray_executor import RayExecutor

        return RayExecutor(config, source)
    if config.executor_backend in EXECUTOR_BACKENDS:
        from tokenmill.executor.multiproc import MultiProcessExecutor

        return MultiProcessExecutor(config, source)
    raise ValueError(f"executor_backend must be one of {EXECUTOR_BACKENDS}, got {config.executor_backend!r}")
