"""The step control of a tensor-parallel rank: every rank stops before the same layer, or none does.

A rank that read the shared interrupt flag on its own could stop before a layer whose all-reduce
its peers are already waiting in, and the group would hang. So before each layer the ranks agree:
the step stops when any rank saw the flag raised (one tiny all-reduce per layer, and only in
steps the scheduler marked interruptible or pausable; other steps never ask).
"""

from __future__ import annotations

import torch

from tokenmill.layers.tensor_parallel import TensorParallel
from tokenmill.step_control import InterruptFlag, StepControl


class CollectiveStepControl(StepControl):
    """``StepControl`` whose stop decision is taken by all ranks together. It gives C++ loops no
    flag tensor to poll (the fused decode stack is not used under tensor parallelism)."""

    def __init__(self, flag: InterruptFlag, tp: TensorParallel) -> None:
        super().__init__(flag, None)
        self.tp = tp

    def should_stop(self, next_layer: int) -> bool:
        if self.flag is None or next_layer == self._stopped_before:  # alike on every rank
            return False
        if not self.tp.any_rank(self.flag.is_raised()):
            return False
        self._stopped_before = next_layer
        return True


def step_control_for(
    flag: InterruptFlag, flag_tensor: torch.Tensor | None, tp: TensorParallel
) -> StepControl:
    """The control of an interruptible or pausable step: the plain one on a single rank."""
    if tp.size == 1:
        return StepControl(flag, flag_tensor)
    return CollectiveStepControl(flag, tp)
