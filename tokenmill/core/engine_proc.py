"""The engine core in its own OS process, talking to its client over two ZMQ ipc:// sockets.

Run as ``python -m tokenmill.core.engine_proc``; ``core/zmq_client.py`` is the client's end. The
server process starts this module with ``subprocess.Popen`` (never ``multiprocessing``, which
pickles) and hands it the ``EngineConfig`` as JSON on the command line. The sockets live in a private
temp folder. Each receiver binds and each sender connects: a connecting PUSH socket queues messages
until its peer is there, so neither side can block or lose a message while the other is starting.

- input (PULL here): ``FrontendMessage`` frames — add requests, abort, utility calls, shutdown;
- output (PUSH here): ``EngineMessage`` frames — ``EngineReady`` once, then step outputs and answers.

Every frame is one msgpack-encoded ``tokenmill.protocol`` struct. The loop drains input without
blocking while there is work and blocks on input when idle. Admission and utility calls are the
engine core's own (``EngineCore.add_request_group``, ``EngineCore.call_utility``), the same the
in-process client uses; this module only moves messages. A request the engine rejects gets an
``AddResult`` with ``error`` set; it never stops the loop. A step that raises is an engine fault: the
process reports ``EngineFault`` and exits, since its state can no longer be trusted. The process also
exits on SIGTERM, on ``ShutdownEngine`` and when its parent process is gone.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING

import msgspec
import zmq

from tokenmill.child_process import child_command, open_child_sockets, parse_child_args
from tokenmill.config import EngineConfig
from tokenmill.protocol import (
    AbortRequests,
    AddRequests,
    EngineCoreOutputs,
    EngineFault,
    EngineMessage,
    EngineReady,
    EngineStartFailed,
    FrontendMessage,
    ShutdownEngine,
    StepOutputs,
    UtilityCall,
    UtilityResult,
)
from tokenmill.step_control import InterruptFlag

if TYPE_CHECKING:
    from tokenmill.core.engine_core import EngineCore

logger = logging.getLogger("tokenmill.engine")

# How long an idle engine blocks on its input before checking that its parent is still alive.
IDLE_POLL_MS = 200


class _Terminated(Exception):
    """Raised by the SIGTERM handler to unwind the loop from wherever it is."""


@dataclass
class EngineProcessHandle:
    """The server's view of a started engine process: the process and the addresses it connects to."""

    process: subprocess.Popen[bytes]
    input_address: str
    output_address: str
    socket_dir: str


def socket_addresses(socket_dir: str) -> tuple[str, str]:
    """The input and output ipc:// addresses inside ``socket_dir`` (short paths: ipc has a ~100 byte limit)."""
    return f"ipc://{socket_dir}/in", f"ipc://{socket_dir}/out"


def make_socket_dir() -> str:
    """A private folder for the ipc sockets, readable only by this user."""
    return tempfile.mkdtemp(prefix="tokenmill-")


def spawn_engine_process(
    config: EngineConfig, socket_dir: str, log_level: str = "INFO"
) -> EngineProcessHandle:
    """Start ``python -m tokenmill.core.engine_proc`` for ``config``.

    The caller binds the output address and connects to the input address (``socket_addresses``),
    then waits for ``EngineReady`` or ``EngineStartFailed`` on the output socket. The child inherits stdout and
    stderr so its log lines appear with the server's.
    """
    input_address, output_address = socket_addresses(socket_dir)
    command = child_command("tokenmill.core.engine_proc", config, input_address, output_address, log_level)
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    return EngineProcessHandle(process, input_address, output_address, socket_dir)


def stop_engine_process(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it lingers; always reaps the process."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class EngineLoop:
    """Runs an ``EngineCore`` against the two sockets until shutdown, a fault or the parent's death.

    Contract: every ``AddRequests`` gets one ``AddResult`` (``EngineCore.add_request_group``: all or
    none, ``overloaded`` with ``retry_after`` when a waiting queue is full) before any output of
    those requests; every ``UtilityCall`` gets one ``UtilityResult``; outputs are sent after every
    step; gauges are re-sent when an idle engine's numbers change (after aborts), so the server's
    metrics never go stale.
    """

    def __init__(
        self,
        core: EngineCore,
        input_socket: zmq.Socket,
        output_socket: zmq.Socket,
        parent_pid: int,
        interrupt: InterruptFlag | None = None,
    ) -> None:
        self.core = core
        self.interrupt = interrupt
        self.input = input_socket
        self.output = output_socket
        self.parent_pid = parent_pid
        self.decoder = msgspec.msgpack.Decoder(FrontendMessage)
        self.encoder = msgspec.msgpack.Encoder()
        self._last_gauges: tuple[int, int, float] | None = None
        self._stopping = False

    def run(self) -> int:
        """Serve until told to stop; returns the process exit code."""
        while not self._stopping:
            if os.getppid() != self.parent_pid:
                logger.warning("the server process is gone; the engine exits")
                return 0
            busy = self.core.has_unfinished_requests()
            # Idle: map the KV cache's next pages, then look for input without waiting while any remain.
            if not busy and not self.input.poll(0 if self.core.prefault_while_idle() else IDLE_POLL_MS):
                continue
            self._drain_input()
            if self._stopping:
                break
            if self.core.has_unfinished_requests():
                try:
                    outputs = self.core.step()
                except Exception as exc:  # an engine fault: report it, then die
                    logger.exception("engine step failed")
                    self._send(EngineFault(error=f"{type(exc).__name__}: {exc}"))
                    return 1
                self._send_outputs(outputs)
            else:
                self._send_gauges_if_changed()
        return 0

    # ------------------------------------------------------------------ input

    def _drain_input(self) -> None:
        if self.interrupt is not None:
            # Whatever raised it is in the input now (the server raises it after sending).
            self.interrupt.clear()
        while not self._stopping:
            try:
                frame = self.input.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = self.decoder.decode(frame)
            except msgspec.ValidationError as exc:
                # Only a bug in the server can send this; log it and keep serving everyone else.
                logger.error("dropping an undecodable message from the server: %s", exc)
                continue
            self._handle(message)

    def _handle(self, message: FrontendMessage) -> None:
        if isinstance(message, AddRequests):
            self._send(self.core.add_request_group(message.requests))
        elif isinstance(message, AbortRequests):
            self.core.abort_requests(message.request_ids)
        elif isinstance(message, UtilityCall):
            self._send(self._call(message))
        elif isinstance(message, ShutdownEngine):
            logger.info("engine shutting down")
            self._stopping = True

    def _call(self, call: UtilityCall) -> UtilityResult:
        try:
            return UtilityResult(call_id=call.call_id, result=self.core.call_utility(call.method, call.args))
        except Exception as exc:
            # A failed call is the caller's answer, not a fault: the engine's state is untouched.
            logger.warning("utility call %s failed: %s", call.method, exc)
            return UtilityResult(call_id=call.call_id, error=f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ output

    def _send(self, message: EngineMessage) -> None:
        self.output.send(self.encoder.encode(message), copy=False)

    def _send_outputs(self, outputs: EngineCoreOutputs) -> None:
        self._last_gauges = (outputs.num_running, outputs.num_waiting, outputs.kv_cache_usage)
        self._send(StepOutputs(outputs=outputs))

    def _send_gauges_if_changed(self) -> None:
        scheduler = self.core.scheduler
        gauges = (scheduler.num_running, scheduler.num_waiting, self.core.kv_manager.usage())
        kv_events = self.core.drain_kv_events()
        if gauges != self._last_gauges or kv_events:
            self._send_outputs(
                EngineCoreOutputs(
                    outputs=[],
                    num_running=gauges[0],
                    num_waiting=gauges[1],
                    kv_cache_usage=gauges[2],
                    num_running_by_tier=scheduler.running_by_tier(),
                    num_waiting_by_tier=scheduler.waiting.waiting_by_tier(),
                    kv_events=kv_events,
                )
            )


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminated


def freeze_startup_objects() -> None:
    """Move every object alive after start-up (modules, model, tokenizer: about 300k objects) out of
    the cyclic garbage collector's reach. A full collection otherwise walks them all, about 110 ms on
    2 cores, and lands in some request's latency as a stall of a whole step."""
    gc.collect()
    gc.freeze()


def engine_ready(core: EngineCore) -> EngineReady:
    """The ``EngineReady`` message announcing a started, warmed-up ``core`` from this process."""
    return EngineReady(
        max_model_len=core.max_model_len,
        num_blocks=core.kv_manager.num_blocks,
        block_size=core.kv_manager.block_size,
        pid=os.getpid(),
        kv_cache_bytes=core.executor.kv_cache_bytes,
    )


def start_failure(exc: Exception) -> EngineStartFailed:
    """Log why the engine failed to start (with the traceback of ``exc``, being handled) and return
    the ``EngineStartFailed`` message that tells the client."""
    logger.error("engine failed to start:\n%s", traceback.format_exc())
    return EngineStartFailed(error=f"{type(exc).__name__}: {exc}")


def run_engine_process(config: EngineConfig, input_address: str, output_address: str, parent_pid: int) -> int:
    """Build the engine, report ready (or why not), and serve; returns the exit code."""
    if config.engine_niceness:
        # Before any thread starts (OpenMP's, ZMQ's): on Linux a thread inherits its creator's niceness.
        os.nice(config.engine_niceness)
        logger.info(
            "engine process niceness raised by %d (the server's work comes first)", config.engine_niceness
        )
    socket_dir = os.path.dirname(input_address.removeprefix("ipc://"))  # made by make_socket_dir
    context, input_socket, output_socket = open_child_sockets(input_address, output_address)
    encoder = msgspec.msgpack.Encoder()
    try:
        try:
            from tokenmill.core.engine_core import EngineCore
            from tokenmill.loader import resolve_model

            core = EngineCore(config, resolve_model(config.model.model))
            logger.info("engine warmed up in %.2f s", core.warm_up())
        except _Terminated:
            raise
        except Exception as exc:
            output_socket.send(encoder.encode(start_failure(exc)))
            return 1
        ready = engine_ready(core)
        interrupt = None
        if config.scheduler.cuts_steps():
            # A request of a tier with a TTFT target, or one with a short prefill, may cut a step short
            # (step_control.py).
            interrupt = InterruptFlag.create(socket_dir)
            core.set_interrupt(interrupt)
        output_socket.send(encoder.encode(ready))
        freeze_startup_objects()
        try:
            return EngineLoop(core, input_socket, output_socket, parent_pid, interrupt).run()
        finally:
            core.shutdown()  # a multi-process executor's worker goes with the engine
    except _Terminated:
        logger.info("engine terminated by SIGTERM")
        return 0
    finally:
        input_socket.close(linger=0)
        output_socket.close(linger=0 if os.getppid() != parent_pid else 1000)
        context.term()
        if os.getppid() != parent_pid:
            # The server died without cleaning up; its socket folder would otherwise stay in /tmp.
            shutil.rmtree(socket_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_child_args("tokenmill engine-core process (started by the server)", "engine", argv)
    # Ctrl-C in a terminal reaches the whole process group; the server decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    sys.exit(run_engine_process(args.config, args.input_address, args.output_address, args.parent_pid))


if __name__ == "__main__":
    main()
