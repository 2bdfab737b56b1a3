"""The executor for one device in the engine core's own process."""

from __future__ import annotations

from tokenmill.config import EngineConfig
from tokenmill.core.step_io import ModelRunnerOutput, SchedulerOutput
from tokenmill.loader import ModelSource
from tokenmill.step_control import InterruptFlag
from tokenmill.worker.model_runner import ModelRunner, SuspendedStep


class InProcessExecutor:
    """Runs scheduled steps on a ModelRunner in this process (tensor parallel size 1)."""

    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.runner = ModelRunner(config, source)

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def kv_window(self) -> int | None:
        """Trailing positions every layer attends to (None: some layer sees the whole sequence)."""
        return self.runner.kv_window

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(plan)

    def resume(self, suspended: object, may_pause: bool) -> ModelRunnerOutput:
        """Go on with a paused step (``StepPaused.suspended``); see ``ModelRunner.resume``."""
        assert isinstance(suspended, SuspendedStep)
        return self.runner.resume(suspended, may_pause)

    def fraction_done(self, suspended: object) -> float:
        """The share of its layers a paused step has run (``SuspendedStep.fraction_done``)."""
        assert isinstance(suspended, SuspendedStep)
        return suspended.fraction_done

    def prefault_while_idle(self) -> bool:
        """See ``ModelRunner.prefault_while_idle``."""
        return self.runner.prefault_while_idle()

    def set_interrupt(self, flag: InterruptFlag | None) -> None:
        """See ``ModelRunner.set_interrupt``."""
        self.runner.set_interrupt(flag)
