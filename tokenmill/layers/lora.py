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

- ``lora_a`` ``[L, P * R, in]``: for a slot of rank ``r``, rows ``p*r .. p*r + r - 1`` are piece
  ``p``'s ``A`` (rows past ``P * r`` unused);
- ``lora_bt`` ``[L, R, out]``: row ``j`` holds column ``j`` of every piece's ``B`` (times the
  adapter's scaling), each in its piece's output columns;
- ``ranks[slot]``: the slot's rank in this layer (0: the adapter does not touch it).

The slots are float32, or bfloat16 for a bfloat16 model on a CPU with AVX512-BF16
(``lora_kernel.slot_dtype``): half the bytes a step reads, ``vdpbf16ps`` products in the shrink.
``pack`` converts an adapter once, when it is read (the CPU cache holds it in the slots' dtype: a
swap-in is a copy).

Under tensor parallelism the deltas are sharded like their base layers: a column-parallel layer
keeps its rows of ``B`` (``A`` whole), a row-parallel layer its columns of ``A`` (``B`` whole), and
its delta joins the partial output before the all-reduce (``shard_a`` / ``shard_b``; ``forward``).

Which rows use which slot is the step's ``LoRABatch``, bound by the model runner around the forward
(``LoRAStepState``): the projections' ``forward(x)`` signature stays that of the base layer, so the
model files are untouched (their MLP and MoE modules take only the hidden states).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from tokenmill.layers import lora_kernel
from tokenmill.layers.linear import ColumnParallelLinear, LinearBase, MergedColumnLinear, RowParallelLinear


@dataclass
class LoRABatch:
    """Which adapter slot each row of a step uses.

    ``row_slots`` ``[num_tokens]`` int64 (-1: the base model), all the C++ kernel reads;
    ``slots_and_counts`` each request's ``(slot, rows)`` in batch order; ``num_tokens`` the step's
    rows. ``segments`` (the torch reference's view) is derived on first use only.
    """

    row_slots: torch.Tensor
    slots_and_counts: list[tuple[int, int]]
    num_tokens: int

    @classmethod
    def build(cls, slots_and_counts: list[tuple[int, int]], device: torch.device) -> LoRABatch | None:
        """From each scheduled request's ``(slot, num_tokens)`` in batch order; None when no row uses
        an adapter (the step runs at the base model's cost)."""
        if all(slot < 0 for slot, _ in slots_and_counts):
            return None
        slots = torch.tensor([slot for slot, _ in slots_and_counts], dtype=torch.long)
        counts = torch.tensor([count for _, count in slots_and_counts], dtype=torch.long)
        row_slots = torch.repeat_interleave(slots, counts).to(device)  # [num_tokens]
        return cls(row_slots=row_slots, slots_and_counts=slots_and_counts, num_tokens=int(counts.sum()))

    @cached_property
    def segments(self) -> list[tuple[int, slice | torch.Tensor]]:
        """The rows of each slot in use: a slice when they are contiguous, else an index tensor."""
        rows_of: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for slot, count in self.slots_and_counts:
            if slot >= 0:
                rows_of.setdefault(slot, []).append((start, count))
            start += count
        segments: list[tuple[int, slice | torch.Tensor]] = []
        for slot, runs in rows_of.items():
            contiguous = all(runs[i][0] + runs[i][1] == runs[i + 1][0] for i in range(len(runs) - 1))
            if contiguous:
                segments.append((slot, slice(runs[0][0], runs[-1][0] + runs[-1][1])))
            else:
                index = [row for first, count in runs for row in range(first, first + count)]
                segments.append((slot, torch.tensor(index, dtype=torch.long, device=self.row_slots.device)))
        return segments


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

    def __init__(
        self,
        base: LinearBase,
        state: LoRAStepState,
        max_loras: int,
        max_rank: int,
        slot_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.base = base
        self.state = state
        self.pieces = layer_pieces(base)
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.max_rank = max_rank
        device = base.weight.device
        num_pieces = len(self.pieces)
        # float32 (or bfloat16 with the vdpbf16ps kernel) whatever the base's dtype or quantization:
        # the kernel accumulates in float32 and the delta is rounded once, when added to the output.
        self.lora_a = torch.zeros(
            max_loras, num_pieces * max_rank, self.in_features, dtype=slot_dtype, device=device
        )
        self.lora_bt = torch.zeros(max_loras, max_rank, self.out_features, dtype=slot_dtype, device=device)
        self.ranks = [0] * max_loras
        self.ranks_tensor = torch.zeros(max_loras, dtype=torch.long, device=device)
        offsets = [offset for _, offset, _ in self.pieces] + [self.out_features]
        self.piece_offsets = torch.tensor(offsets, dtype=torch.long, device=device)

    def full_pieces(self) -> list[tuple[str, int, int]]:
        """``(name, offset, width)`` of the pieces in the unsharded layer (a checkpoint's ``B`` rows)."""
        base = self.base
        if isinstance(base, MergedColumnLinear):
            pieces, offset = [], 0
            for name, size in base.full_sizes.items():
                pieces.append((name, offset, size))
                offset += size
            return pieces
        if isinstance(base, ColumnParallelLinear):
            return [("", 0, base.out_features * base.tp.size)]
        return [("", 0, self.out_features)]

    def shard_a(self, a: torch.Tensor, label: str) -> torch.Tensor:
        """This rank's part of a checkpoint ``lora_A`` ``[r, in]``: a row-parallel layer's columns of
        its input features, else the whole; ValueError (naming ``label``) for a wrong width."""
        first, count = (
            self.base.features if isinstance(self.base, RowParallelLinear) else (0, self.in_features)
        )
        whole = not (isinstance(self.base, RowParallelLinear) and self.base.tp.size > 1)
        if (whole and a.shape[1] != self.in_features) or a.shape[1] < first + count:
            raise ValueError(f"{label} lora_A has {a.shape[1]} inputs, the base layer {self.in_features}")
        return a[:, first : first + count]

    def shard_b(self, piece: str, b: torch.Tensor, label: str) -> torch.Tensor:
        """This rank's rows of piece ``piece``'s checkpoint ``lora_B`` ``[out, r]`` (a column-parallel
        layer's output features, else the whole); ValueError (naming ``label``) for a wrong height."""
        full = {name: size for name, _, size in self.full_pieces()}[piece]
        if b.shape[0] != full:
            raise ValueError(f"{label} lora_B has {b.shape[0]} outputs, the base layer {full}")
        base = self.base
        if isinstance(base, MergedColumnLinear):
            first, count = base.shard_ranges[piece]
        elif isinstance(base, ColumnParallelLinear):
            first, count = base.features
        else:
            return b
        return b[first : first + count]

    def pack(self, a: torch.Tensor, bt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``a`` ``[P * rank, in]`` and ``bt`` ``[rank, out]`` in the slots' dtype, for
        ``set_slot`` (done once, when an adapter is read: the CPU cache holds the packed copy)."""
        return a.to(self.lora_a.dtype).contiguous(), bt.to(self.lora_a.dtype).contiguous()

    def set_slot(self, slot: int, rank: int, a: torch.Tensor | None, bt: torch.Tensor | None) -> None:
        """Fill ``slot`` with ``pack``'s ``a`` and ``bt`` (scaling folded in), or rank 0 (the adapter
        leaves this layer alone)."""
        self.ranks[slot] = rank
        self.ranks_tensor[slot] = rank
        if rank == 0 or a is None or bt is None:
            return
        self.lora_a[slot, : a.shape[0]].copy_(a)
        self.lora_bt[slot, : bt.shape[0]].copy_(bt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        if isinstance(base, RowParallelLinear) and base.tp.size > 1:
            # The delta of this rank's input features joins its partial output; the all-reduce sums.
            return base.reduce(self._add_delta(base.partial(x), x))
        return self._add_delta(base(x), x)

    def _add_delta(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out`` ``[num_tokens, out_features]`` plus each row's delta (in place), when a step with
        adapters is bound and ``x`` is its rows."""
        batch = self.state.batch
        if batch is None or x.dim() != 2 or x.shape[0] != batch.num_tokens:
            return out
        if self.lora_a.dtype == torch.bfloat16 or lora_kernel.applies_to(x):
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
