"""The executor whose workers run in child processes: one, or one per tensor-parallel rank.

The engine core's process keeps the scheduler; each child (``executor/worker_proc.py``) keeps the
model (its shard under tensor parallelism), the KV cache tensors (its heads), a paused step and each
request's state. Plans cross as deltas (``executor/plan_delta.py``), everything as msgspec structs of ``protocol.py`` over two ZMQ ipc
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

import msgspec
import zmq

from tokenmill.child_process import child_command
from tokenmill.config import EngineConfig
from tokenmill.executor.rank_group import RankGroupExecutor, WorkerProcessError
from tokenmill.loader import ModelSource
from tokenmill.protocol import ShutdownWorker, WorkerFailed, WorkerReply, WorkerRequest
from tokenmill.worker.distributed import free_tcp_port

logger = logging.getLogger(__name__)

__all__ = ["MultiProcessExecutor", "WorkerProcessError", "config_for_ranks"]

# How often a wait for the workers checks that they are still alive. Replies arrive at once; this
# only bounds how late a death is noticed.
LIVENESS_POLL_MS = 200
# How long shutdown waits for the workers to exit on SIGTERM before they are killed.
EXIT_WAIT_S = 5.0


class MultiProcessExecutor(RankGroupExecutor):
    """Runs each step on ``ModelRunner``s in child processes (``executor/base.py`` contract): one, or
    one per tensor-parallel rank (``config.tensor_parallel_size``), joined by torch.distributed.

    Requests are answered one at a time, in order: each method sends one message to every rank and
    waits for every rank's reply, watching every process meanwhile (``executor/rank_group.py``).
    Once a worker has failed or died, all of them are stopped and every call raises
    ``WorkerProcessError``.
    """

    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        super().__init__(config.tensor_parallel_size)
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
        try:
            readies = self._ready()
        except WorkerProcessError:
            self.shutdown()
            raise
        logger.info("worker process(es) %s ready", ", ".join(str(ready.pid) for ready in readies))

    @property
    def worker_pid(self) -> int:
        """Rank 0's process id."""
        return self._processes[0].pid

    @property
    def worker_pids(self) -> list[int]:
        """Every rank's process id, in rank order."""
        return [process.pid for process in self._processes]

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

    def _stop(self) -> None:
        self._finalizer()

    def _exited_rank(self, other_than: int) -> tuple[int, str] | None:
        for rank, process in enumerate(self._processes):
            code = process.poll()
            if rank != other_than and code is not None:
                return rank, f"exited with code {code}"
        return None

    def _exchange(self, message: WorkerRequest | None, what: str) -> list[WorkerReply | None]:
        """Every rank's reply, in rank order; fails when a process exits before its rank answered
        (its peers could wait in a collective for it forever: all are stopped)."""
        if message is not None:
            data = self._encode(message)
            for sock in self._to_workers:
                sock.send(data)
        replies: list[WorkerReply | None] = [None] * self._size
        pending = set(range(self._size))
        while pending:
            ready = dict(self._poller.poll(LIVENESS_POLL_MS))
            for rank in sorted(pending):
                sock = self._from_workers[rank]
                if sock in ready:
                    replies[rank] = self._decode(sock.recv())
                    pending.discard(rank)
            if any(isinstance(reply, WorkerFailed) for reply in replies):
                break  # the failing rank exits next; its report says why
            for rank, process in enumerate(self._processes):
                code = process.poll()
                # A rank that exited may have reported why just before: read that first.
                if code is not None and not (rank in pending and self._from_workers[rank].poll(0)):
                    self._fail(f"{self._worker_name(rank)} exited with code {code} while {what}")
        return replies


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
