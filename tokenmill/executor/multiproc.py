"""The executor whose workers run in child processes: one, or one per tensor-parallel rank.

The engine core's process keeps the scheduler; each child (``executor/worker_proc.py``) keeps the
model (its shard under tensor parallelism), the KV cache tensors (its heads), a paused step and each
request's state. Plans cross as deltas
(``executor/plan_delta.py``), everything as msgspec structs of ``protocol.py`` over two ZMQ ipc
sockets in a private temp folder. A worker that fails to start or dies is a ``RuntimeError`` in the
engine, never a hang: every wait polls the sockets in slices and checks every process in between.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import subprocess
import tempfile
import time
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
from tokenmill.worker.distributed import free_tcp_port

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
    """Runs each step on ``ModelRunner``s in child processes (``executor/base.py`` contract): one, or
    one per tensor-parallel rank (``config.tensor_parallel_size``), joined by torch.distributed.

    Every rank gets every request, the same bytes (one ``PlanEncoder``: all ranks keep the same
    per-request state); each answers, and rank 0's answer is the step's output (the other ranks
    sample nothing). Requests are answered one at a time, in order: each method sends one message
    and waits for every rank's reply, watching every process meanwhile. Once a worker has failed or
    died, all of them are stopped and every call raises ``WorkerProcessError``.
    """

    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self._size = config.tensor_parallel_size
        self._socket_dir = tempfile.mkdtemp(prefix="tokenmill-w-")
        self._context = zmq.Context()
        self._to_workers: list[zmq.Socket] = []
        self._from_workers: list[zmq.Socket] = []
        self._poller = zmq.Poller()
        init_method = f"tcp://127.0.0.1:{free_tcp_port()}" if self._size > 1 else None
        rank_config = config_for_ranks(config)
        log_level = logging.getLevelName(logging.getLogger("tokenmill").getEffectiveLevel())
        self._processes: list[subprocess.Popen[bytes]] = []
        for rank in range(self._size):
            input_address = f"ipc://{self._socket_dir}/in{rank}"
            output_address = f"ipc://{self._socket_dir}/out{rank}"
            to_worker, from_worker = self._context.socket(zmq.PUSH), self._context.socket(zmq.PULL)
            for sock in (to_worker, from_worker):
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, 0)
                sock.setsockopt(zmq.SNDHWM, 0)
            from_worker.bind(output_address)
            to_worker.connect(input_address)
            self._to_workers.append(to_worker)
            self._from_workers.append(from_worker)
            self._poller.register(from_worker, zmq.POLLIN)
            extra = (
                ["--tp-rank", str(rank), "--tp-size", str(self._size), "--tp-init-method", init_method]
                if init_method is not None
                else None
            )
            command = child_command(
                "tokenmill.executor.worker_proc", rank_config, input_address, output_address, log_level, extra
            )
            self._processes.append(subprocess.Popen(command, stdin=subprocess.DEVNULL))
        # Stops the children even when nobody calls shutdown (an LLM dropped, the interpreter exiting).
        self._finalizer = weakref.finalize(
            self, _stop_workers, list(self._processes), self._context, self._socket_dir
        )
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(WorkerReply).decode
        self._failure: str | None = None
        self._plans = PlanEncoder()
        try:
            readies = self._receive("starting", WorkerReady)
        except WorkerProcessError:
            self.shutdown()
            raise
        # One pool for all ranks: each sized its own the same way, but free memory may differ a little.
        self._num_blocks = min(ready.num_blocks for ready in readies)
        self._kv_window = readies[0].kv_window
        self._kv_cache_bytes = readies[0].kv_cache_bytes
        logger.info("worker process(es) %s ready", ", ".join(str(ready.pid) for ready in readies))

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
        """Rank 0's process id."""
        return self._processes[0].pid

    @property
    def worker_pids(self) -> list[int]:
        """Every rank's process id, in rank order."""
        return [process.pid for process in self._processes]

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        self._send(ExecuteStep(plan=self._plans.encode(plan)))
        return output_from_wire(self._receive("running a step", StepDone)[0])

    def resume(self, may_pause: bool) -> ModelRunnerOutput:
        self._send(ResumeStep(may_pause=may_pause))
        return output_from_wire(self._receive("resuming a step", StepDone)[0])

    def discard_paused(self) -> None:
        self._send(DiscardPausedStep())
        self._receive("discarding a paused step", WorkerCallResult)

    def prefault_while_idle(self) -> bool:
        return any(bool(result) for result in self.collective_rpc("prefault_while_idle"))

    def set_interrupt(self, flag: InterruptFlag | None) -> None:
        """The workers map the same flag file (``flag.folder``), so the server's byte reaches them."""
        if flag is not None and flag.folder is None:
            raise ValueError(
                "the multi-process executor needs an interrupt flag made by InterruptFlag.create"
            )
        self._send(SetInterruptFlag(folder=None if flag is None else flag.folder))
        self._receive("attaching the interrupt flag", WorkerCallResult)

    def collective_rpc(self, method: str, args: list[object] | None = None) -> list[object]:
        """Every rank's result, in rank order. A call that raises in a worker raises ``RuntimeError``
        here; the workers go on serving."""
        self._send(WorkerCall(method=method, args=list(args or [])))
        answers = self._receive(f"calling {method}", WorkerCallResult)
        for answer in answers:
            if answer.error is not None:
                raise RuntimeError(f"worker call {method} failed: {answer.error}")
        return [answer.result for answer in answers]

    def shutdown(self) -> None:
        alive = all(process.poll() is None for process in self._processes)
        if self._finalizer.alive and alive and self._failure is None:
            # A send that fails changes nothing: the processes are stopped below either way.
            with contextlib.suppress(zmq.ZMQError, subprocess.TimeoutExpired):
                message = self._encode(ShutdownWorker())
                for sock in self._to_workers:
                    sock.send(message, zmq.NOBLOCK)
                for process in self._processes:
                    process.wait(EXIT_WAIT_S)  # a clean exit first; SIGTERM below otherwise
        self._failure = self._failure or "the executor was shut down"
        self._finalizer()

    # ------------------------------------------------------------------ the wire

    def _send(self, message: WorkerRequest) -> None:
        if self._failure is not None:
            raise WorkerProcessError(self._failure)
        data = self._encode(message)
        for sock in self._to_workers:
            sock.send(data)

    def _worker_name(self, rank: int) -> str:
        return (
            "the worker process" if self._size == 1 else f"the worker process of tensor-parallel rank {rank}"
        )

    def _receive(self, what: str, expected: type[_Reply]) -> list[_Reply]:
        """Every rank's reply, of type ``expected``, in rank order; raises ``WorkerProcessError`` when
        one reports a failure or a process exits before its rank answered (its peers could wait in
        a collective for it forever: all are stopped)."""
        replies: list[_Reply | None] = [None] * self._size
        pending = set(range(self._size))
        while pending:
            ready = dict(self._poller.poll(LIVENESS_POLL_MS))
            for rank in sorted(pending):
                sock = self._from_workers[rank]
                if sock in ready:
                    replies[rank] = self._check(rank, self._decode(sock.recv()), what, expected)
                    pending.discard(rank)
            for rank, process in enumerate(self._processes):
                code = process.poll()
                # A rank that exited may have reported why just before: read that first.
                if code is not None and not (rank in pending and self._from_workers[rank].poll(0)):
                    self._fail(f"{self._worker_name(rank)} exited with code {code} while {what}")
        return [reply for reply in replies if reply is not None]

    def _check(self, rank: int, reply: WorkerReply, what: str, expected: type[_Reply]) -> _Reply:
        if isinstance(reply, WorkerFailed):
            # A rank whose peer died fails in its next collective: the peer's death is the cause.
            for other, process in enumerate(self._processes):
                code = process.poll()
                if other != rank and code is not None:
                    self._fail(
                        f"{self._worker_name(other)} exited with code {code} while {what} "
                        f"(rank {rank} then failed: {reply.error})"
                    )
            self._fail(f"{self._worker_name(rank)} failed while {what}: {reply.error}")
        if not isinstance(reply, expected):
            self._fail(f"{self._worker_name(rank)} answered {type(reply).__name__} while {what}")
        return reply

    def _fail(self, message: str) -> NoReturn:
        self._failure = message
        self._finalizer()
        raise WorkerProcessError(message)


def config_for_ranks(config: EngineConfig) -> EngineConfig:
    """The config each rank runs with: under tensor parallelism on a CPU, the engine's threads
    (``num_threads``, else every core this process may use) split evenly over the ranks unless
    ``threads_per_rank`` says how many each gets."""
    size = config.tensor_parallel_size
    if size == 1 or config.model.device != "cpu":
        return config
    threads = config.threads_per_rank or max(1, (config.num_threads or available_cores()) // size)
    return dataclasses.replace(config, num_threads=threads)


def available_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _stop_workers(processes: list[subprocess.Popen[bytes]], context: zmq.Context, socket_dir: str) -> None:
    """SIGTERM (a worker exits cleanly on it, or has already on ``ShutdownWorker``), then SIGKILL for
    those that linger (a rank blocked in a collective with a dead peer never sees the SIGTERM);
    always reaps them, closes the sockets and removes their folder."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + EXIT_WAIT_S
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    context.destroy(linger=0)
    shutil.rmtree(socket_dir, ignore_errors=True)
