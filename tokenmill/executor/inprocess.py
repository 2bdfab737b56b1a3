"""The executor for one device in the engine core's own process: plans go to the runner as objects."""

from __future__ import annotations

from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.step_io import ModelRunnerOutput, SchedulerOutput
from tokenmill.loader import ModelSource
from tokenmill.step_control import InterruptFlag
from tokenmill.worker.model_runner import ModelRunner


class InProcessExecutor:
    """Runs scheduled steps on a ModelRunner in this process (tensor parallel size 1). The runner
    keeps a paused step itself, so every method is a direct call (``executor/base.py``)."""

    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.runner = ModelRunner(config, source)

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def kv_cache_bytes(self) -> int:
        return self.runner.kv_cache_bytes

    @property
    def kv_window(self) -> int | None:
        return self.runner.kv_window

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(plan)

    def resume(self, may_pause: bool) -> ModelRunnerOutput:
        return self.runner.resume(may_pause)

    def discard_paused(self) -> None:
        self.runner.discard_paused()

    def prefault_while_idle(self) -> bool:
        return self.runner.prefault_while_idle()

    def set_interrupt(self, flag: InterruptFlag | None) -> None:
        self.runner.set_interrupt(flag)

    def collective_rpc(self, method: str, args: list[Any] | None = None) -> list[Any]:
        return [call_runner_method(self.runner, method, args or [])]

    def shutdown(self) -> None:
        """Nothing to release: the runner goes with this process."""


def call_runner_method(runner: ModelRunner, method: str, args: list[Any]) -> Any:
    """``runner.<method>(*args)`` for a public method (private ones are not reachable by name)."""
    if method.startswith("_") or not callable(getattr(runner, method, None)):
        raise AttributeError(f"ModelRunner has no public method {method!r}")
    return getattr(runner, method)(*args)
