"""Step interrupts: a latency-critical arrival cuts the step in flight short between layers.

A request that arrives during a step otherwise waits for that step to end, then for its own prefill.
Two kinds of arrival do not wait (the server decides, ``frontend/step_cuts.py``): a request of a
tier with a TTFT target (``core/tiers.py`` also keeps worse tiers' steps short for it), and, with
``SchedulerConfig.short_prefill_interrupt``, one whose prompt needs only a short prefill beyond the
prefix cache (a follow-up turn, an agent's next call: on a CPU its prefill costs about what the
decode pass in flight does, so waiting for that pass would double its time to first token). With
an interrupt the server raises a one-byte flag in shared memory right after sending such a request;
the model checks it between decoder layers and abandons the step (``StepInterrupted``). Nothing of
the step is kept: the scheduler's state is as it was planned (no tokens counted, no outputs, blocks
already reserved stay reserved for the same tokens), and those tokens are planned again after the
new request's step. The keys and values the abandoned layers wrote go to the same slots when the
step is redone. Only plans the scheduler marks ``interruptible`` are cut (``Scheduler._may_be_cut``:
for TTFT tiers none that compute a protected first token, for short prefills only steps of decodes
alone, and never two in a row), so the running requests always make progress.

The flag is a one-byte file in the folder of the engine's ipc sockets, mapped by both processes:
the engine process creates it; the server sets it; the engine clears it before it reads its input.
No pickle, no locks: a byte written by one process and polled by the other.
"""

from __future__ import annotations

import mmap
import os

FLAG_FILE = "interrupt"


class StepInterrupted(Exception):
    """The model abandoned the step between layers because the interrupt flag was raised."""


class InterruptFlag:
    """A shared one-byte flag in ``<folder>/interrupt``. ``create`` makes the file (the engine process);
    ``attach`` maps an existing one (the server). ``buffer`` is the writable mapping (a tensor view of
    it lets C++ kernels poll the same byte)."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer

    @classmethod
    def create(cls, folder: str) -> InterruptFlag:
        path = os.path.join(folder, FLAG_FILE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"\0")
            return cls(mmap.mmap(fd, 1))
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
            return cls(mmap.mmap(fd, 1))
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
