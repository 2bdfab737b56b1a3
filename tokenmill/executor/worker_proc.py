"""A worker process: one ``ModelRunner`` serving a ``MultiProcessExecutor`` over two ZMQ ipc sockets.

The executor starts it with ``subprocess.Popen([python, -m, tokenmill.executor.worker_proc, ...])``
and the ``EngineConfig`` as JSON (never ``multiprocessing``, which pickles). It binds its input
(PULL), connects its output (PUSH), loads the model and answers ``WorkerReady`` or ``WorkerFailed``;
then each request (``protocol.WorkerRequest``) gets exactly one reply, except ``ShutdownWorker``.
Plans arrive as deltas and are rebuilt by a ``PlanDecoder``; a paused step stays here until it is
resumed or discarded. A request that raises is answered ``WorkerFailed`` and the process exits (its
state may be half-updated). It exits too when its parent is gone, checked while it waits for input.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
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
    ShutdownWorker,
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


def run_worker(config: EngineConfig, input_address: str, output_address: str, parent_pid: int) -> int:
    """Load the runner, report ready (or why not), and serve requests; returns the exit code."""
    context, input_socket, output_socket = open_child_sockets(input_address, output_address)
    encoder = msgspec.msgpack.Encoder()

    def send(message: WorkerReply) -> None:
        output_socket.send(encoder.encode(message))

    try:
        try:
            # Imported here: torch and the model code take seconds, and a failure is to be reported.
            from tokenmill.executor.plan_delta import PlanDecoder
            from tokenmill.loader import resolve_model
            from tokenmill.worker.model_runner import ModelRunner

            runner = ModelRunner(config, resolve_model(config.model.model))
        except _Terminated:
            raise
        except Exception as exc:
            logger.error("worker failed to start:\n%s", traceback.format_exc())
            send(WorkerFailed(error=f"{type(exc).__name__}: {exc}"))
            return 1
        send(
            WorkerReady(
                num_blocks=runner.num_blocks,
                kv_cache_bytes=runner.kv_cache_bytes,
                kv_window=runner.kv_window,
                pid=os.getpid(),
            )
        )
        serve(runner, PlanDecoder(runner.device), input_socket, send, parent_pid)
        return 0
    except _Terminated:
        return 0
    except _RequestFailed:
        return 1
    finally:
        input_socket.close(linger=0)
        output_socket.close(linger=1000 if os.getppid() == parent_pid else 0)
        context.term()


class _RequestFailed(Exception):
    """A request raised; ``WorkerFailed`` was sent."""


def serve(
    runner: ModelRunner,
    decoder: PlanDecoder,
    input_socket: zmq.Socket,
    send: Callable[[WorkerReply], None],
    parent_pid: int,
) -> None:
    """Answer requests until ``ShutdownWorker`` or the parent's death; raises ``_RequestFailed``
    after reporting a request that raised."""
    from tokenmill.executor.plan_delta import output_to_wire
    from tokenmill.step_control import InterruptFlag

    decode = msgspec.msgpack.Decoder(WorkerRequest).decode
    while True:
        if not input_socket.poll(PARENT_CHECK_MS):
            if os.getppid() != parent_pid:
                logger.warning("the engine process is gone; worker exiting")
                return
            continue
        message = decode(input_socket.recv())
        try:
            if isinstance(message, ExecuteStep):
                send(output_to_wire(runner.execute(decoder.decode(message.plan))))
            elif isinstance(message, ResumeStep):
                send(output_to_wire(runner.resume(message.may_pause)))
            elif isinstance(message, DiscardPausedStep):
                runner.discard_paused()
                send(WorkerCallResult())
            elif isinstance(message, SetInterruptFlag):
                flag = None if message.folder is None else InterruptFlag.attach(message.folder)
                if message.folder is not None and flag is None:
                    raise FileNotFoundError(f"no interrupt flag in {message.folder}")
                runner.set_interrupt(flag)
                send(WorkerCallResult())
            elif isinstance(message, WorkerCall):
                send(_call(runner, message))
            elif isinstance(message, ShutdownWorker):
                return
        except Exception as exc:
            logger.error("worker request %s failed:\n%s", type(message).__name__, traceback.format_exc())
            send(WorkerFailed(error=f"{type(exc).__name__}: {exc}"))
            raise _RequestFailed from exc


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
    sys.exit(run_worker(args.config, args.input_address, args.output_address, args.parent_pid))


if __name__ == "__main__":
    main()
