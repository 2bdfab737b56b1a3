"""A tensor-parallel rank's view of its group: who it is, and the two collectives the layers use.

Every sharded layer takes a ``TensorParallel`` and asks it which slice of a checkpoint tensor to
keep and how to combine partial results. ``SINGLE`` (size 1, no process group) makes every layer a
plain one and every collective a no-op, so the one-process path pays nothing. The process group is
made by ``worker/distributed.py`` (gloo on CPU, nccl on CUDA): the default group of the worker
processes, one rank each, so its rank 0 is the group's rank 0. Layers never create a group.

Contract: the collectives are called in the same order on every rank. Ranks run the same plans
through the same code, so this holds as long as no rank decides on its own to skip a layer (the
step control's stop decision is made collectively: ``worker/tp_step_control.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``size`` in ``group`` (None only when ``size == 1``); ``expert_parallel``:
    mixture-of-experts layers split their experts over the ranks rather than each expert's features."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed.ProcessGroup
    expert_parallel: bool = False

    @property
    def is_first(self) -> bool:
        """Rank 0: the one that samples and answers the executor with tokens."""
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks in place (row-parallel partial outputs); returns it."""
        if self.size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def any_rank(self, value: bool) -> bool:
        """Whether ``value`` is true on any rank (a decision every rank must take alike)."""
        if self.size == 1:
            return value
        flag = torch.tensor([1 if value else 0], dtype=torch.int32, device=self._device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def gather_columns(self, local: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets every rank's ``local`` ``[rows, part]`` side by side ``[rows, size * part]``;
        the other ranks get None (they never sample). Every rank's ``local`` has the same shape."""
        if self.size == 1:
            return local
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.is_first else None
        dist.gather(local, parts, dst=0, group=self.group)  # the group is the workers' whole world
        return torch.cat(parts, dim=-1) if parts is not None else None

    def even_range(self, size: int, what: str) -> tuple[int, int]:
        """``(first, count)`` of this rank's even share of ``size`` features; ValueError naming
        ``what`` when they do not divide."""
        if size % self.size:
            raise ValueError(f"{what} ({size}) do not split evenly across {self.size} tensor-parallel ranks")
        count = size // self.size
        return self.rank * count, count

    def head_ranges(self, num_heads: int, num_kv_heads: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """``((first query head, count), (first KV head, count))`` this rank attends with.

        With at least as many KV heads as ranks, each rank takes a contiguous run of KV heads (as
        even as it gets: 3 over 2 ranks is 1 and 2) with the query heads that read them. With fewer,
        each KV head is replicated on ``size // num_kv_heads`` ranks, which split its query heads.
        """
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly")
        group = num_heads // num_kv_heads
        if num_kv_heads >= self.size:
            first = self.rank * num_kv_heads // self.size
            count = (self.rank + 1) * num_kv_heads // self.size - first
            return (first * group, count * group), (first, count)
        if self.size % num_kv_heads or num_heads % self.size:
            raise ValueError(
                f"{num_kv_heads} KV heads and {num_heads} query heads cannot be shared by "
                f"{self.size} tensor-parallel ranks (with fewer KV heads than ranks, the rank count "
                "must be a multiple of the KV heads and divide the query heads)"
            )
        per_rank = num_heads // self.size
        return (self.rank * per_rank, per_rank), (self.rank // (self.size // num_kv_heads), 1)

    def _device(self) -> torch.device:
        backend = dist.get_backend(self.group)
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


SINGLE = TensorParallel()
