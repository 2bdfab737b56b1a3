"""What every executor over a group of worker ranks shares, whatever carries its messages.

The engine side of a tensor-parallel group (or of one worker out of process) is the same whether the
ranks are child processes over ZMQ (``executor/multiproc.py``) or Ray actors
(``executor/ray_executor.py``): every rank gets every request, the same msgspec bytes (one
``PlanEncoder``: all ranks keep the same per-request state); each answers; rank 0's answer is the
step's output (the other ranks sample nothing). A subclass supplies ``_exchange`` (send one request
to every rank, return every rank's reply, raise ``WorkerProcessError`` when a rank dies) and
``_stop`` (stop every rank); this class checks the replies and turns any failure into a stopped
group and a ``WorkerProcessError`` on this and every later call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NoReturn, TypeVar

from tokenmill.core.step_io import ModelRunnerOutput, SchedulerOutput
from tokenmill.executor.plan_delta import PlanEncoder, output_from_wire
from tokenmill.protocol import (
    DiscardPausedStep,
    ExecuteStep,
    ResumeStep,
    SetInterruptFlag,
    StepDone,
    WorkerCall,
    WorkerCallResult,
    WorkerFailed,
    WorkerReady,
    WorkerReply,
    WorkerRequest,
)
from tokenmill.step_control import InterruptFlag

_Reply = TypeVar("_Reply", WorkerReady, StepDone, WorkerCallResult)


class WorkerProcessError(RuntimeError):
    """A worker failed to start, failed a request, or died; the executor runs nothing more."""


class RankGroupExecutor(ABC):
    """The ``executor/base.py`` contract over ``size`` ranks reached through ``_exchange``."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._failure: str | None = None
        self._plans = PlanEncoder()
        self._num_blocks = 0
        self._kv_window: int | None = None
        self._kv_cache_bytes = 0

    # ------------------------------------------------------------------ for subclasses

    @abstractmethod
    def _exchange(self, message: WorkerRequest | None, what: str) -> list[WorkerReply | None]:
        """Send ``message`` to every rank (None: only collect the replies to starting) and return
        every rank's reply in rank order, or stop early (None for the ranks not heard) once one
        answered ``WorkerFailed``; raise ``WorkerProcessError`` (through ``_fail``) when a rank
        dies before it answered."""

    @abstractmethod
    def _stop(self) -> None:
        """Stop every rank now (idempotent)."""

    @abstractmethod
    def _exited_rank(self, other_than: int) -> tuple[int, str] | None:
        """A rank other than ``other_than`` that is gone, and how it ended; None when all live."""

    def _worker_name(self, rank: int) -> str:
        return (
            "the worker process" if self._size == 1 else f"the worker process of tensor-parallel rank {rank}"
        )

    def _ready(self, what: str = "starting") -> list[WorkerReady]:
        """Collect every rank's ``WorkerReady``; sizes the KV pool to the smallest rank's (each
        sized its own the same way, but free memory may differ a little)."""
        readies = self._ask(None, what, WorkerReady)
        self._num_blocks = min(ready.num_blocks for ready in readies)
        self._kv_window = readies[0].kv_window
        self._kv_cache_bytes = readies[0].kv_cache_bytes
        return readies

    def _ask(self, message: WorkerRequest | None, what: str, expected: type[_Reply]) -> list[_Reply]:
        if self._failure is not None:
            raise WorkerProcessError(self._failure)
        replies = self._exchange(message, what)
        for rank, reply in enumerate(replies):
            if isinstance(reply, WorkerFailed):
                self._check(rank, reply, what, expected)  # raises
        return [self._check(rank, reply, what, expected) for rank, reply in enumerate(replies)]

    def _check(self, rank: int, reply: WorkerReply | None, what: str, expected: type[_Reply]) -> _Reply:
        if isinstance(reply, WorkerFailed):
            # A rank whose peer died fails in its next collective: the peer's death is the cause.
            exited = self._exited_rank(rank)
            if exited is not None:
                other, how = exited
                self._fail(
                    f"{self._worker_name(other)} {how} while {what} (rank {rank} then failed: {reply.error})"
                )
            self._fail(f"{self._worker_name(rank)} failed while {what}: {reply.error}")
        if not isinstance(reply, expected):
            self._fail(f"{self._worker_name(rank)} answered {type(reply).__name__} while {what}")
        return reply

    def _fail(self, message: str) -> NoReturn:
        self._failure = message
        self._stop()
        raise WorkerProcessError(message)

    # ------------------------------------------------------------------ the executor contract

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def kv_cache_bytes(self) -> int:
        return self._kv_cache_bytes

    @property
    def kv_window(self) -> int | None:
        return self._kv_window

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        return output_from_wire(
            self._ask(ExecuteStep(plan=self._plans.encode(plan)), "running a step", StepDone)[0]
        )

    def resume(self, may_pause: bool) -> ModelRunnerOutput:
        return output_from_wire(self._ask(ResumeStep(may_pause=may_pause), "resuming a step", StepDone)[0])

    def discard_paused(self) -> None:
        self._ask(DiscardPausedStep(), "discarding a paused step", WorkerCallResult)

    def prefault_while_idle(self) -> bool:
        return any(bool(result) for result in self.collective_rpc("prefault_while_idle"))

    def set_interrupt(self, flag: InterruptFlag | None) -> None:
        """The workers map the same flag file (``flag.folder``), so the server's byte reaches them."""
        if flag is not None and flag.folder is None:
            raise ValueError(
                "an out-of-process executor needs an interrupt flag made by InterruptFlag.create"
            )
        self._ask(
            SetInterruptFlag(folder=None if flag is None else flag.folder),
            "attaching the interrupt flag",
            WorkerCallResult,
        )

    def collective_rpc(self, method: str, args: list[object] | None = None) -> list[object]:
        """Every rank's result, in rank order. A call that raises in a worker raises ``RuntimeError``
        here; the workers go on serving."""
        answers = self._ask(
            WorkerCall(method=method, args=list(args or [])), f"calling {method}", WorkerCallResult
        )
        for answer in answers:
            if answer.error is not None:
                raise RuntimeError(f"worker call {method} failed: {answer.error}")
        return [answer.result for answer in answers]
