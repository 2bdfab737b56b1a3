"""The executor whose worker runs in one child process (the base tensor parallelism builds on).

The engine core's process keeps the scheduler; the child (``executor/worker_proc.py``) keeps the
model, the KV cache tensors, a paused step and each request's state. Plans cross as deltas
(``executor/plan_delta.py``), everything as msgspec structs of ``protocol.py`` over two ZMQ ipc
sockets in a private temp folder. A worker that fails to start or dies is a ``RuntimeError`` in the
engine, never a hang: every wait polls the socket in slices and checks the process in between.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import tempfile
import weakref
from typing import NoReturn, TypeVar

import msgspec
import zmq

from tokenmill.child_process import child_command
from tokenmill.config import EngineConfig
from tokenmill.core.step_io import ModelRunnerOutput, SchedulerOutput
from tokenmill.executor.plan_delta import PlanEncoder, output_from_wire
from tokenmill.loader import ModelSource
from tokenmill.protocol import (
    DiscardPausedStep,
    ExecuteStep,
    ResumeStep,
    SetInterruptFlag,
    ShutdownWorker,
    StepDone,
    WorkerCall,
    WorkerCallResult,
    WorkerFailed,
    WorkerReady,
    WorkerReply,
    WorkerRequest,
)
from tokenmill.step_control import InterruptFlag

logger = logging.getLogger(__name__)

_Reply = TypeVar("_Reply", WorkerReady, StepDone, WorkerCallResult)

# How often a wait for the worker checks that it is still alive. Replies arrive at once; this only
# bounds how late a death is noticed.
LIVENESS_POLL_MS = 200
# How long shutdown waits for the worker to exit on SIGTERM before it is killed.
EXIT_WAIT_S = 5.0


class WorkerProcessError(RuntimeError):
    """The worker failed to start, failed a request, or died; the executor runs nothing more."""


class MultiProcessExecutor:
    """Runs each step on a ``ModelRunner`` in one child process (``executor/base.py`` contract).

    Requests are answered one at a time, in order: each method sends one message and waits for its
    reply. Once the worker has failed, every call raises ``WorkerProcessError``.
    """

    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self._socket_dir = tempfile.mkdtemp(prefix="tokenmill-w-")
        input_address = f"ipc://{self._socket_dir}/in"
        output_address = f"ipc://{self._socket_dir}/out"
        self._context = zmq.Context()
        self._to_worker = self._context.socket(zmq.PUSH)
        self._from_worker = self._context.socket(zmq.PULL)
        for sock in (self._to_worker, self._from_worker):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
        self._from_worker.bind(output_address)
        self._to_worker.connect(input_address)
        log_level = logging.getLevelName(logging.getLogger("tokenmill").getEffectiveLevel())
        command = child_command(
            "tokenmill.executor.worker_proc", config, input_address, output_address, log_level
        )
        self._process = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        # Stops the child even when nobody calls shutdown (an LLM dropped, the interpreter exiting).
        self._finalizer = weakref.finalize(self, _stop_worker, self._process, self._context, self._socket_dir)
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(WorkerReply).decode
        self._failure: str | None = None
        self._plans = PlanEncoder()
        try:
            ready = self._receive("starting", WorkerReady)
        except WorkerProcessError:
            self.shutdown()
            raise
        self._num_blocks, self._kv_window = ready.num_blocks, ready.kv_window
        self._kv_cache_bytes = ready.kv_cache_bytes
        logger.info("worker process %d ready", ready.pid)

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def kv_cache_bytes(self) -> int:
        return self._kv_cache_bytes

    @property
    def kv_window(self) -> int | None:
        return self._kv_window

    @property
    def worker_pid(self) -> int:
        return self._process.pid

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        self._send(ExecuteStep(plan=self._plans.encode(plan)))
        return output_from_wire(self._receive("running a step", StepDone))

    def resume(self, may_pause: bool) -> ModelRunnerOutput:
        self._send(ResumeStep(may_pause=may_pause))
        return output_from_wire(self._receive("resuming a step", StepDone))

    def discard_paused(self) -> None:
        self._send(DiscardPausedStep())
        self._receive("discarding a paused step", WorkerCallResult)

    def prefault_while_idle(self) -> bool:
        return bool(self.collective_rpc("prefault_while_idle")[0])

    def set_interrupt(self, flag: InterruptFlag | None) -> None:
        """The worker maps the same flag file (``flag.folder``), so the server's byte reaches it."""
        if flag is not None and flag.folder is None:
            raise ValueError(
                "the multi-process executor needs an interrupt flag made by InterruptFlag.create"
            )
        self._send(SetInterruptFlag(folder=None if flag is None else flag.folder))
        self._receive("attaching the interrupt flag", WorkerCallResult)

    def collective_rpc(self, method: str, args: list[object] | None = None) -> list[object]:
        """A call that raises in the worker raises ``RuntimeError`` here; the worker goes on serving."""
        self._send(WorkerCall(method=method, args=list(args or [])))
        answer = self._receive(f"calling {method}", WorkerCallResult)
        if answer.error is not None:
            raise RuntimeError(f"worker call {method} failed: {answer.error}")
        return [answer.result]

    def shutdown(self) -> None:
        if self._finalizer.alive and self._process.poll() is None and self._failure is None:
            # A send that fails changes nothing: the process is stopped below either way.
            with contextlib.suppress(zmq.ZMQError, subprocess.TimeoutExpired):
                self._to_worker.send(self._encode(ShutdownWorker()), zmq.NOBLOCK)
                self._process.wait(EXIT_WAIT_S)  # a clean exit first; SIGTERM below otherwise
        self._failure = self._failure or "the executor was shut down"
        self._finalizer()

    # ------------------------------------------------------------------ the wire

    def _send(self, message: WorkerRequest) -> None:
        if self._failure is not None:
            raise WorkerProcessError(self._failure)
        self._to_worker.send(self._encode(message))

    def _receive(self, what: str, expected: type[_Reply]) -> _Reply:
        """The worker's reply, of type ``expected``; raises ``WorkerProcessError`` when it reports a
        failure or exits before answering."""
        while not self._from_worker.poll(LIVENESS_POLL_MS):
            code = self._process.poll()
            if code is not None:
                # It may have reported why just before it exited.
                if self._from_worker.poll(0):
                    break
                self._fail(f"the worker process exited with code {code} while {what}")
        reply = self._decode(self._from_worker.recv())
        if isinstance(reply, WorkerFailed):
            self._fail(f"the worker process failed while {what}: {reply.error}")
        if not isinstance(reply, expected):
            self._fail(f"the worker process answered {type(reply).__name__} while {what}")
        return reply

    def _fail(self, message: str) -> NoReturn:
        self._failure = message
        self._finalizer()
        raise WorkerProcessError(message)


def _stop_worker(process: subprocess.Popen[bytes], context: zmq.Context, socket_dir: str) -> None:
    """SIGTERM (the worker exits cleanly on it, or has already on ``ShutdownWorker``), then SIGKILL if
    it lingers; always reaps it, closes the sockets and removes their folder."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    context.destroy(linger=0)
    shutil.rmtree(socket_dir, ignore_errors=True)
