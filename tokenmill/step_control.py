"""Step control: whether a step in flight stops between layers, and the shared flag that asks it to.

A request that arrives during a step otherwise waits for that step to end, then for its own prefill.
Two kinds of arrival do not wait (the server decides, ``frontend/step_cuts.py``): a request of a
tier with a TTFT target (``core/tiers.py`` also keeps worse tiers' steps short for it), and, with
``SchedulerConfig.short_prefill_interrupt``, one whose prompt needs only a short prefill beyond the
prefix cache (a follow-up turn, an agent's next call: on a CPU its prefill costs about what a decode
pass does, and a fraction of another request's long prefill, so waiting for the pass in flight would
double its time to first token or worse). The server raises a one-byte flag in shared memory right
after sending such a request; between decoder layers the model asks the step's ``StepControl``
whether to stop, and when it says so the forward returns a ``LayerProgress`` (how far it got) instead
of hidden states. The model runner turns that into the step's status, ``StepStatus.PAUSED`` or
``StepStatus.ABANDONED`` (``core/step_io.py``), returned through the executor to the engine core;
nothing is raised on the way. What happens to the stopped step depends on its plan:

- **Paused** (plans the scheduler marks ``pausable``, for short prefills: any step but one that
  finishes a short prefill itself or computes a first token a TTFT target protects,
  ``Scheduler.may_pause``). The executor keeps the step's batch and the hidden states and residual
  stream going into the next layer and returns ``PAUSED``; the engine core reads its input, runs a
  pass of its own for the waiting requests with short prefills (``Scheduler.schedule_beside``: no
  preemption, no running request; under the ``ttft`` admission as many as keep their mean time to
  first token least, and then another pass for the rest, up to ``MAX_ARRIVAL_PASSES_PER_PAUSE`` in a
  row), sends their first tokens, then goes on with the paused step from that layer. Nothing is
  computed twice. Under ``lpm`` a paused step of fresh prompts that has run at most a quarter of its
  layers is instead put back when a waiting request now ranks above all of its requests (a burst
  sharing a new prefix arrived just after an unrelated prompt started: ``Scheduler.replan_paused``);
  those requests wait again, once at most. A step pauses at most
  ``MAX_PAUSES_PER_STEP`` times and a resumed pass runs a layer before it stops again, so its
  requests keep moving; aborts of its requests wait until it ends (their blocks are its to write).
- **Abandoned** (plans the scheduler marks ``interruptible``, for TTFT tiers: any step that computes
  no first token such a tier protects, never two in a row, ``StepBounds.may_be_cut`` in ``core/step_bounds.py``). Nothing of
  the step is kept: the scheduler's state is as it was planned (no tokens counted, no outputs, blocks
  already reserved stay reserved for the same tokens), and those tokens are planned again after the
  new request's step, which may serve only that tier. The keys and values the abandoned layers wrote
  go to the same slots when the step is redone.

The flag is a one-byte file in the folder of the engine's ipc sockets, mapped by both processes:
the engine process creates it; the server sets it; the engine clears it before it reads its input.
No pickle, no locks: a byte written by one process and polled by the other.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # tensors only in annotations: the core imports this module and never torch
    import torch

FLAG_FILE = "interrupt"


@dataclass
class LayerProgress:
    """How far a forward pass that its ``StepControl`` stopped got: ``next_layer`` is the first layer
    not run, ``hidden`` its input ``[num_tokens, hidden_size]`` and ``residual`` the residual stream
    (None before the first layer, and for a model whose stream is ``hidden`` itself: Gemma 3). The
    keys and values of the layers before it are in the cache."""

    next_layer: int
    hidden: torch.Tensor  # [num_tokens, hidden_size]
    residual: torch.Tensor | None  # [num_tokens, hidden_size]


class StepControl:
    """The one object a forward pass asks, between layers, whether to stop the step now.

    ``flag`` (None: the step is never stopped) is the shared interrupt flag; ``flag_tensor`` the same
    byte as a ``[1]`` uint8 tensor for C++ loops that poll it themselves (the fused CPU decode stack),
    None when there is no flag. A pass that stopped before a layer and goes on from there runs that
    layer before it may stop again, so every pass makes progress: ``should_stop`` and ``stopped_at``
    remember where the last stop was. Layers never raise to stop a step; they return a
    ``LayerProgress``.
    """

    def __init__(self, flag: InterruptFlag | None = None, flag_tensor: torch.Tensor | None = None) -> None:
        self.flag = flag
        self.flag_tensor = flag_tensor if flag is not None else None
        self._stopped_before: int | None = None

    def should_stop(self, next_layer: int) -> bool:
        """Whether the pass stops before ``next_layer`` (then return ``LayerProgress`` there): the flag
        is raised and this is not the layer the pass last stopped before (it resumes with that one)."""
        if self.flag is None or next_layer == self._stopped_before or not self.flag.is_raised():
            return False
        self._stopped_before = next_layer
        return True

    def stopped_at(self, next_layer: int) -> None:
        """Record a stop made without ``should_stop`` (a C++ loop polling ``flag_tensor``)."""
        self._stopped_before = next_layer


# Steps that may not be stopped share this one (it never stops, so it never records a stop).
NEVER_STOP = StepControl()


class InterruptFlag:
    """A shared one-byte flag in ``<folder>/interrupt``. ``create`` makes the file (the engine process);
    ``attach`` maps an existing one (the server). ``buffer`` is the writable mapping (a tensor view of
    it lets C++ kernels poll the same byte). ``folder`` is where the file is, so that another process
    (a worker: ``executor/multiproc.py``) can ``attach`` the same flag."""

    def __init__(self, buffer: mmap.mmap, folder: str | None = None) -> None:
        self.buffer = buffer
        self.folder = folder

    @classmethod
    def create(cls, folder: str) -> InterruptFlag:
        path = os.path.join(folder, FLAG_FILE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"\0")
            return cls(mmap.mmap(fd, 1), folder)
        finally:
            os.close(fd)

    @classmethod
    def attach(cls, folder: str) -> InterruptFlag | None:
        """The flag the engine created in ``folder``, or None if there is none (an engine without
        interrupts)."""
        path = os.path.join(folder, FLAG_FILE)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            return cls(mmap.mmap(fd, 1), folder)
        finally:
            os.close(fd)

    def raise_(self) -> None:
        self.buffer[0] = 1

    def clear(self) -> None:
        self.buffer[0] = 0

    def is_raised(self) -> bool:
        return self.buffer[0] != 0

    def close(self) -> None:
        self.buffer.close()
