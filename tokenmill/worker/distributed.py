"""Joining a tensor-parallel group: torch.distributed among the executor's worker processes.

Each worker process is one rank. The backend follows the device, never a flag: ``nccl`` for CUDA
(each rank on its own GPU, ``cuda:<local rank>``), ``gloo`` on CPU. Rendezvous is a TCP store at
``init_method`` (``tcp://host:port``; the executor picks a free port on rank 0's host). On CPU the
ranks split the cores: each gets ``threads`` torch threads, pinned to its own cores when the process
may use enough of them, so two ranks' OpenMP pools never fight over one core.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from tokenmill.layers.tensor_parallel import TensorParallel

logger = logging.getLogger(__name__)

# How long a collective (and the rendezvous) may wait for a peer before it raises. A dead peer is
# noticed by the executor long before (it watches every worker process); this only bounds a wedge.
GROUP_TIMEOUT_S = 600.0


def backend_for(device: torch.device) -> str:
    """``nccl`` on CUDA, ``gloo`` elsewhere (the CPU)."""
    return "nccl" if device.type == "cuda" else "gloo"


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the rendezvous binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def join_tensor_parallel_group(
    rank: int, size: int, init_method: str, device: torch.device
) -> tuple[TensorParallel, torch.device]:
    """Initialise this process's torch.distributed default group as ``rank`` of ``size``; returns
    the rank's ``TensorParallel`` and the device it computes on (a CUDA rank gets its own GPU)."""
    if device.type == "cuda":
        local = rank % torch.cuda.device_count()
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    backend = backend_for(device)
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )
    logger.info("tensor-parallel rank %d of %d joined (%s on %s)", rank, size, backend, device)
    return TensorParallel(rank=rank, size=size, group=dist.group.WORLD), device


def leave_tensor_parallel_group() -> None:
    """Destroy an nccl group this process joined (at a clean exit: nccl warns about one left
    behind); a gloo group goes with the process. Safe to call when it joined none."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        dist.destroy_process_group()


def split_cpu_threads(rank: int, threads: int) -> None:
    """Use ``threads`` torch threads; pin this process to cores ``[rank * threads, (rank + 1) *
    threads)`` of the ones it may run on, when there are that many (else leave the affinity alone)."""
    torch.set_num_threads(threads)
    if not hasattr(os, "sched_getaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    mine = cores[rank * threads : (rank + 1) * threads]
    if len(mine) == threads:
        os.sched_setaffinity(0, mine)
        logger.info("rank %d pinned to cores %s", rank, mine)
