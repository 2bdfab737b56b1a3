"""How tokenmill starts a child process of its own: the engine core (``core/engine_proc.py``) and an
executor's worker (``executor/worker_proc.py``).

A child is ``python -m <module>`` under ``subprocess.Popen``, never ``multiprocessing`` (which
pickles); its ``EngineConfig`` travels as JSON on the command line, with the two ipc:// addresses it
talks on and its parent's pid (it exits when that process is gone). This module is a leaf: it
imports nothing of tokenmill but the config.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass

import msgspec
import zmq

from tokenmill.config import EngineConfig


def child_command(
    module: str,
    config: EngineConfig,
    input_address: str,
    output_address: str,
    log_level: str,
    extra: list[str] | None = None,
) -> list[str]:
    """The command line that starts ``module``'s ``main`` as a child of this process; ``extra`` are
    module-specific options (a worker's tensor-parallel rank) that ``parse_child_args`` reads."""
    return [
        sys.executable,
        "-m",
        module,
        "--config-json",
        msgspec.json.encode(config).decode(),
        "--input-address",
        input_address,
        "--output-address",
        output_address,
        "--parent-pid",
        str(os.getpid()),
        "--log-level",
        log_level,
        *(extra or []),
    ]


@dataclass
class ChildArgs:
    """What a child got on its command line (``child_command``)."""

    config: EngineConfig
    input_address: str
    output_address: str
    parent_pid: int
    # A worker's place in its tensor-parallel group (rank 0 of 1 when alone) and the rendezvous.
    tp_rank: int = 0
    tp_size: int = 1
    tp_init_method: str | None = None


def parse_child_args(description: str, log_tag: str, argv: list[str] | None = None) -> ChildArgs:
    """Read a child's command line and set up its logging, each line tagged ``[log_tag]`` so the
    parent's terminal tells the processes apart (the child inherits stdout and stderr)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--input-address", required=True)
    parser.add_argument("--output-address", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--tp-init-method", default=None)
    args = parser.parse_args(argv)
    if args.tp_size > 1:
        log_tag = f"{log_tag} rank {args.tp_rank}"
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [{log_tag}] %(name)s: %(message)s",
    )
    config = msgspec.json.decode(args.config_json, type=EngineConfig)
    return ChildArgs(
        config,
        args.input_address,
        args.output_address,
        args.parent_pid,
        args.tp_rank,
        args.tp_size,
        args.tp_init_method,
    )


def open_child_sockets(input_address: str, output_address: str) -> tuple[zmq.Context, zmq.Socket, zmq.Socket]:
    """A child's context, its input socket (PULL, bound) and its output socket (PUSH, connected):
    unbounded queues, and a second at most to flush unsent messages when it closes (once it
    decides to exit they are worthless; it must not hang on them)."""
    context = zmq.Context()
    input_socket = context.socket(zmq.PULL)
    output_socket = context.socket(zmq.PUSH)
    for sock in (input_socket, output_socket):
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
    input_socket.bind(input_address)
    output_socket.connect(output_address)
    return context, input_socket, output_socket
