"""LoRA-wrapped linear layers: the base projection plus each row's adapter delta, batched.

A ``LoRALinear`` wraps a projection (``LinearBase``: plain, merged QKV / gate-up, any base dtype or
quantization) and adds, for every row of the step, ``B_s (A_s x) * scaling`` of the adapter in the
row's device slot ``s`` (no adapter: nothing). The adapters live in fixed slots of stacked tensors
(``lora/manager.py`` fills them); weights are never merged, so one step mixes any slots and the
base. The delta is computed for all rows at once by a segmented shrink/expand: rows grouped by slot
(``LoRABatch.segments``), one shrink and one expand per slot and piece (``lora_delta_reference``),
or, on CPU for float32 and bfloat16 activations, one C++ call over all rows of any step
(``csrc/lora_cpu.cpp`` via ``layers/lora_kernel.py``, register-tiled, threads over slot chunks).

Layout of one wrapped layer with ``P`` pieces (the merged layer's shards: q/k/v or gate/up; one for
a plain layer), ``R`` the largest rank and ``L`` slots:

- ``lora_a`` ``[L, P * R, in]`` (float32, as ``lora_bt``): for a slot of rank ``r``, rows ``p*r .. p*r + r - 1`` are piece
  ``p``'s ``A`` (rows past ``P * r`` unused);
- ``lora_bt`` ``[L, R, out]``: row ``j`` holds column ``j`` of every piece's ``B`` (times the
  adapter's scaling), each in its piece's output columns;
- ``ranks[slot]``: the slot's rank in this layer (0: the adapter does not touch it).

Which rows use which slot is the step's ``LoRABatch``, bound by the model runner around the forward
(``LoRAStepState``): the projections' ``forward(x)`` signature stays that of the base layer, so the
model files are untouched (their MLP and MoE modules take only the hidden states).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.layers import lora_kernel
from tokenmill.layers.linear import LinearBase, MergedColumnLinear


@dataclass
class LoRABatch:
    """Which adapter slot each row of a step uses.

    ``row_slots`` ``[num_tokens]`` int64 (-1: the base model); ``segments`` the rows of each slot in
    use, as a slice when they are contiguous, else an index tensor; ``num_tokens`` the step's rows.
    """

    row_slots: torch.Tensor
    segments: list[tuple[int, slice | torch.Tensor]]
    num_tokens: int

    @classmethod
    def build(cls, slots_and_counts: list[tuple[int, int]], device: torch.device) -> LoRABatch | None:
        """From each scheduled request's ``(slot, num_tokens)`` in batch order; None when no row uses
        an adapter (the step runs at the base model's cost)."""
        if all(slot < 0 for slot, _ in slots_and_counts):
            return None
        row_slots: list[int] = []
        rows_of: dict[int, list[tuple[int, int]]] = {}
        for slot, count in slots_and_counts:
            if slot >= 0:
                rows_of.setdefault(slot, []).append((len(row_slots), count))
            row_slots.extend([slot] * count)
        segments: list[tuple[int, slice | torch.Tensor]] = []
        for slot, runs in rows_of.items():
            contiguous = all(runs[i][0] + runs[i][1] == runs[i + 1][0] for i in range(len(runs) - 1))
            if contiguous:
                segments.append((slot, slice(runs[0][0], runs[-1][0] + runs[-1][1])))
            else:
                index = [row for start, count in runs for row in range(start, start + count)]
                segments.append((slot, torch.tensor(index, dtype=torch.long, device=device)))
        row_tensor = torch.tensor(row_slots, dtype=torch.long, device=device)
        return cls(row_slots=row_tensor, segments=segments, num_tokens=len(row_slots))


class LoRAStepState:
    """The step's ``LoRABatch`` as the wrapped layers see it, bound by the model runner for the
    duration of one forward (``bound``); None outside a forward and for steps without adapters. One
    object per model runner, shared by its wrapped layers; never module-level."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None

    @contextlib.contextmanager
    def bound(self, batch: LoRABatch | None) -> Iterator[None]:
        self.batch = batch
        try:
            yield
        finally:
            self.batch = None


def layer_pieces(base: LinearBase) -> list[tuple[str, int, int]]:
    """``(name, output offset, width)`` of the pieces an adapter may change separately: the shards
    of a merged layer (``q``, ``k``, ``v`` / ``gate``, ``up``), else one piece ``""``."""
    if isinstance(base, MergedColumnLinear):
        return [(name, offset, size) for name, (offset, size) in base.shard_offsets.items()]
    return [("", 0, base.out_features)]


class LoRALinear(nn.Module):
    """``base(x)`` plus the delta of each row's adapter slot (see the module docstring)."""

    def __init__(self, base: LinearBase, state: LoRAStepState, max_loras: int, max_rank: int) -> None:
        super().__init__()
        self.base = base
        self.state = state
        self.pieces = layer_pieces(base)
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.max_rank = max_rank
        device = base.weight.device
        num_pieces = len(self.pieces)
        # float32 whatever the activations: the kernel's loops then need no conversions, and the
        # delta is rounded once, when it is added to the base output.
        self.lora_a = torch.zeros(max_loras, num_pieces * max_rank, self.in_features, device=device)
        self.lora_bt = torch.zeros(max_loras, max_rank, self.out_features, device=device)
        self.ranks = [0] * max_loras
        self.ranks_tensor = torch.zeros(max_loras, dtype=torch.long, device=device)
        offsets = [offset for _, offset, _ in self.pieces] + [self.out_features]
        self.piece_offsets = torch.tensor(offsets, dtype=torch.long, device=device)

    def set_slot(self, slot: int, rank: int, a: torch.Tensor | None, bt: torch.Tensor | None) -> None:
        """Fill ``slot``: ``a`` ``[P * rank, in]`` and ``bt`` ``[rank, out]`` (scaling folded in), or
        rank 0 (the adapter leaves this layer alone)."""
        self.ranks[slot] = rank
        self.ranks_tensor[slot] = rank
        if rank == 0 or a is None or bt is None:
            return
        self.lora_a[slot, : a.shape[0]].copy_(a)
        self.lora_bt[slot, :rank].copy_(bt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)  # [num_tokens, out_features]
        batch = self.state.batch
        if batch is None or x.dim() != 2 or x.shape[0] != batch.num_tokens:
            return out
        if lora_kernel.applies_to(x):
            lora_kernel.lora_delta(
                out, x, self.lora_a, self.lora_bt, self.ranks_tensor, batch.row_slots, self.piece_offsets
            )
        else:
            lora_delta_reference(out, x, self.lora_a, self.lora_bt, self.ranks, batch.segments, self.pieces)
        return out

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        """The base merged layer's ``split`` (its output's shards, in construction order)."""
        assert isinstance(self.base, MergedColumnLinear)
        return self.base.split(out)


def lora_delta_reference(
    out: torch.Tensor,  # [num_tokens, out_features], updated in place
    x: torch.Tensor,  # [num_tokens, in_features]
    lora_a: torch.Tensor,  # [slots, P * R, in_features]
    lora_bt: torch.Tensor,  # [slots, R, out_features]
    ranks: list[int],
    segments: list[tuple[int, slice | torch.Tensor]],
    pieces: list[tuple[str, int, int]],
) -> None:
    """Add every row's adapter delta to ``out`` with torch matrix products: per slot in use, one
    shrink over its rows and one expand per piece (a loop over slots, never over requests)."""
    num_pieces = len(pieces)
    for slot, rows in segments:
        rank = ranks[slot]
        if rank == 0:
            continue
        xs = x[rows].float()  # [n, in_features]
        shrunk = xs @ lora_a[slot, : num_pieces * rank].T  # [n, P * rank] float32
        delta = torch.zeros(xs.shape[0], out.shape[1], device=out.device)
        for index, (_, offset, size) in enumerate(pieces):
            part = shrunk[:, index * rank : (index + 1) * rank]  # [n, rank]
            delta[:, offset : offset + size] = part @ lora_bt[slot, :rank, offset : offset + size]
        if isinstance(rows, slice):
            out[rows] = (out[rows].float() + delta).to(out.dtype)
        else:
            out.index_copy_(0, rows, (out.index_select(0, rows).float() + delta).to(out.dtype))
