"""The executor seam: what the engine core asks of whatever runs its plans on devices.

An executor owns one or more workers (each a ``ModelRunner`` over a device) and runs each planned
step on all of them. Everything it hands back is typed: ``execute`` returns a ``ModelRunnerOutput``
whose ``status`` says whether the step ran to the end, paused between layers or was abandoned
(``step_control.py``). No exception stands for a stop, and no object crosses for a paused step:
the executor keeps that step and ``resume`` goes on with it.
"""

from __future__ import annotations

from typing import Any, Protocol

from tokenmill.core.step_io import ModelRunnerOutput, SchedulerOutput
from tokenmill.step_control import InterruptFlag


class Executor(Protocol):
    """Runs the engine core's plans. Implementations: ``InProcessExecutor`` (the runner in this
    process, plans passed as objects), ``MultiProcessExecutor`` (the runner in a child process per
    tensor-parallel rank, plans sent as deltas over ZMQ) and ``RayExecutor`` (the ranks as Ray
    actors); the last two share ``executor/rank_group.py``.

    Contract: ``execute`` runs plans in the order given (workers keep per-request state from one plan
    to the next) and returns ``DONE`` with a token per sampling request, ``PAUSED`` (a ``pausable``
    plan, kept until ``resume`` or ``discard_paused``; at most one is kept, and plans run meanwhile
    are never pausable) or ``ABANDONED`` (an ``interruptible`` plan; nothing of it counts). A worker
    that fails raises ``RuntimeError`` in the caller; it never hangs it.
    """

    @property
    def num_blocks(self) -> int:
        """KV cache blocks each worker allocated (the KV manager's pool size)."""
        ...

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of KV cache each worker reserved for its ``num_blocks`` blocks."""
        ...

    @property
    def kv_window(self) -> int | None:
        """Trailing positions every layer attends to (None: some layer sees the whole sequence)."""
        ...

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """Run one planned step on every worker; the output of the first (all agree)."""
        ...

    def resume(self, may_pause: bool) -> ModelRunnerOutput:
        """Go on with the paused step from the layer it stopped before; with ``may_pause`` it may
        come back ``PAUSED`` again, else it runs to the end."""
        ...

    def discard_paused(self) -> None:
        """Drop the paused step (its plan was put back and will be planned anew); no-op if none."""
        ...

    def prefault_while_idle(self) -> bool:
        """Map a few KV blocks' pages ahead of use (a few milliseconds); whether more remain."""
        ...

    def set_interrupt(self, flag: InterruptFlag | None) -> None:
        """Let interruptible and pausable steps stop between layers while ``flag`` is raised."""
        ...

    def collective_rpc(self, method: str, args: list[Any] | None = None) -> list[Any]:
        """Call the public ``ModelRunner`` method ``method`` with ``args`` on every worker; their
        results in worker order. Across processes ``args`` and results must be msgspec-encodable
        (weight updates, LoRA slots)."""
        ...

    def shutdown(self) -> None:
        """Release the workers; idempotent. The executor runs nothing afterwards."""
        ...
