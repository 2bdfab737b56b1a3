"""A worker process: one ``ModelRunner`` serving a ``MultiProcessExecutor`` over two ZMQ ipc sockets.

The executor starts it with ``subprocess.Popen([python, -m, tokenmill.executor.worker_proc, ...])``
and the ``EngineConfig`` as JSON (never ``multiprocessing``, which pickles). It binds its input
(PULL), connects its output (PUSH), loads the model and answers ``WorkerReady`` or ``WorkerFailed``;
then each request (``protocol.WorkerRequest``) gets exactly one reply, except ``ShutdownWorker``.
Plans arrive as deltas and are rebuilt by a ``PlanDecoder``; a paused step stays here until it is
resumed or discarded. Under tensor parallelism every rank is such a process with the same requests
(``WorkerHandler`` answers them; the Ray actor reuses it): each first joins the torch.distributed
group, then loads only its shard. A request that raises is answered ``WorkerFailed`` and the process exits (its
state may be half-updated). It exits too when its parent is gone, checked while it waits for input.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING

import msgspec
import zmq

from tokenmill.child_process import open_child_sockets, parse_child_args
from tokenmill.config import EngineConfig
from tokenmill.protocol import (
    DiscardPausedStep,
    ExecuteStep,
    ResumeStep,
    SetInterruptFlag,
    WorkerCall,
    WorkerCallResult,
    WorkerFailed,
    WorkerReady,
    WorkerReply,
    WorkerRequest,
)

if TYPE_CHECKING:
    from tokenmill.executor.plan_delta import PlanDecoder
    from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# How long the worker blocks on its input before checking that its parent is still alive.
PARENT_CHECK_MS = 1000


class _Terminated(BaseException):
    """SIGTERM: leave at once (a BaseException, so no request handler takes it for a failure)."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminated


def run_worker(
    config: EngineConfig,
    input_address: str,
    output_address: str,
    parent_pid: int,
    placement: RankPlacement | None = None,
) -> int:
    """Load the runner, report ready (or why not), and serve requests; returns the exit code."""
    context, input_socket, output_socket = open_child_sockets(input_address, output_address)
    encoder = msgspec.msgpack.Encoder()

    def send(message: WorkerReply) -> None:
        output_socket.send(encoder.encode(message))

    try:
        try:
            handler = WorkerHandler.start(config, placement or RankPlacement())
        except _Terminated:
            raise
        except Exception as exc:
            logger.error("worker failed to start:\n%s", traceback.format_exc())
            send(WorkerFailed(error=f"{type(exc).__name__}: {exc}"))
            return 1
        send(handler.ready())
        serve(handler, input_socket, send, parent_pid)
        handler.close()
        return 0
    except _Terminated:
        return 0
    except _RequestFailed:
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a SIGTERM now just ends what is ending anyway
        input_socket.close(linger=0)
        output_socket.close(linger=1000 if os.getppid() == parent_pid else 0)
        context.term()


class _RequestFailed(Exception):
    """A request raised; ``WorkerFailed`` was sent."""


@dataclass(frozen=True)
class RankPlacement:
    """Where a worker stands in its tensor-parallel group: rank ``rank`` of ``size``, meeting the
    others at ``init_method`` (``tcp://host:port``; None when alone)."""

    rank: int = 0
    size: int = 1
    init_method: str | None = None


class WorkerHandler:
    """One rank's runner and plan decoder, answering ``WorkerRequest``s one at a time. Shared by the
    worker process (requests over ZMQ) and the Ray actor (``executor/ray_worker.py``)."""

    def __init__(self, runner: ModelRunner, decoder: PlanDecoder) -> None:
        self.runner = runner
        self.decoder = decoder

    @classmethod
    def start(cls, config: EngineConfig, placement: RankPlacement) -> WorkerHandler:
        """Join the tensor-parallel group (when there is one) and load this rank's shard."""
        # Imported here: torch and the model code take seconds, and a failure is to be reported.
        import torch

        from tokenmill.executor.plan_delta import PlanDecoder
        from tokenmill.layers.tensor_parallel import SINGLE
        from tokenmill.loader import resolve_model
        from tokenmill.worker.distributed import join_tensor_parallel_group, split_cpu_threads
        from tokenmill.worker.model_runner import ModelRunner

        tp = SINGLE
        if placement.size > 1:
            assert placement.init_method is not None
            device = torch.device(config.model.device)
            tp, device = join_tensor_parallel_group(
                placement.rank, placement.size, placement.init_method, device
            )
            tp = dataclasses.replace(tp, expert_parallel=config.enable_expert_parallel)
            if device.type == "cpu" and config.num_threads:
                split_cpu_threads(placement.rank, config.num_threads)
        runner = ModelRunner(config, resolve_model(config.model.model), tp=tp)
        return cls(runner, PlanDecoder(runner.device))

    def ready(self) -> WorkerReady:
        runner = self.runner
        return WorkerReady(
            num_blocks=runner.num_blocks,
            kv_cache_bytes=runner.kv_cache_bytes,
            kv_window=runner.kv_window,
            pid=os.getpid(),
        )

    def handle(self, message: WorkerRequest) -> WorkerReply | None:
        """The reply to ``message`` (None for ``ShutdownWorker``); an exception means the worker's
        state can no longer be trusted (the caller reports it and stops)."""
        from tokenmill.executor.plan_delta import output_to_wire
        from tokenmill.step_control import InterruptFlag

        runner = self.runner
        if isinstance(message, ExecuteStep):
            return output_to_wire(runner.execute(self.decoder.decode(message.plan)))
        if isinstance(message, ResumeStep):
            return output_to_wire(runner.resume(message.may_pause))
        if isinstance(message, DiscardPausedStep):
            runner.discard_paused()
            return WorkerCallResult()
        if isinstance(message, SetInterruptFlag):
            flag = None if message.folder is None else InterruptFlag.attach(message.folder)
            if message.folder is not None and flag is None:
                raise FileNotFoundError(f"no interrupt flag in {message.folder}")
            runner.set_interrupt(flag)
            return WorkerCallResult()
        if isinstance(message, WorkerCall):
            return _call(runner, message)
        return None  # ShutdownWorker

    def close(self) -> None:
        """Leave the tensor-parallel group (after a clean shutdown)."""
        from tokenmill.worker.distributed import leave_tensor_parallel_group

        leave_tensor_parallel_group()


def serve(
    handler: WorkerHandler,
    input_socket: zmq.Socket,
    send: Callable[[WorkerReply], None],
    parent_pid: int,
) -> None:
    """Answer requests until ``ShutdownWorker`` or the parent's death; raises ``_RequestFailed``
    after reporting a request that raised."""
    decode = msgspec.msgpack.Decoder(WorkerRequest).decode
    while True:
        if not input_socket.poll(PARENT_CHECK_MS):
            if os.getppid() != parent_pid:
                logger.warning("the engine process is gone; worker exiting")
                return
            continue
        message = decode(input_socket.recv())
        try:
            reply = handler.handle(message)
        except Exception as exc:
            logger.error("worker request %s failed:\n%s", type(message).__name__, traceback.format_exc())
            send(WorkerFailed(error=f"{type(exc).__name__}: {exc}"))
            raise _RequestFailed from exc
        if reply is None:
            return
        send(reply)


def _call(runner: ModelRunner, call: WorkerCall) -> WorkerCallResult:
    """``call`` on the runner; what it raised is answered, not fatal (a bad name, a bad argument)."""
    from tokenmill.executor.inprocess import call_runner_method

    try:
        return WorkerCallResult(result=call_runner_method(runner, call.method, call.args))
    except Exception as exc:
        return WorkerCallResult(error=f"{type(exc).__name__}: {exc}")


def main(argv: list[str] | None = None) -> None:
    args = parse_child_args("tokenmill worker process (started by the engine)", "worker", argv)
    # Ctrl-C reaches the whole process group; the engine decides when its worker stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    placement = RankPlacement(args.tp_rank, args.tp_size, args.tp_init_method)
    code = run_worker(args.config, args.input_address, args.output_address, args.parent_pid, placement)
    # Everything is released by now (sockets closed, an nccl group destroyed); the interpreter's own
    # teardown of torch and the kernels takes seconds on a busy machine and would only delay the
    # engine's shutdown, which waits for its workers.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
