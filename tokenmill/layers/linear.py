"""Linear layers that know how to load (and shard) their weights.

Tensor parallelism splits a column-parallel layer's output features and a row-parallel layer's
input features across ranks; each layer's ``load_weight`` takes the full checkpoint tensor and keeps
its rank's slice. With ``tp_size == 1`` (the default) they are plain linear layers. Merged layers
(QKV, gate-up) hold several checkpoint tensors side by side so one matmul computes them all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.batch_invariant import invariant_product
from tokenmill.layers.cpu_gemm import (
    PackedWeight,
    bf16_row_linear,
    pack_weight,
    packed_linear,
    packing_available,
)
from tokenmill.layers.int4 import Int4Weight, int4_pairs_available, quantize_int4_weight
from tokenmill.layers.level_sums import LevelWeight, five_bit_weight
from tokenmill.layers.q8 import Q8Weight, exact_q8_weight, exact_small_level_groups
from tokenmill.layers.quantization import dequantize_int8_rows, int8_linear, int8_rows, quantize_int8_rows
from tokenmill.layers.tensor_parallel import SINGLE, TensorParallel


def _shard(tensor: torch.Tensor, dim: int, features: tuple[int, int]) -> torch.Tensor:
    """The ``(start, count)`` slice of ``tensor`` along ``dim`` (the whole tensor when it is that)."""
    start, count = features
    if start == 0 and count == tensor.shape[dim]:
        return tensor
    if start + count > tensor.shape[dim]:
        raise ValueError(
            f"features {start}..{start + count} are outside dimension {dim} of {tuple(tensor.shape)}"
        )
    return tensor.narrow(dim, start, count)


def _first_row_is_int4(weight: torch.Tensor) -> bool:
    """Whether row 0 of ``weight`` ``[out, in]`` survives int4 groups unchanged (a quick screen: a
    weight that was not loaded from 4-bit groups fails it at once)."""
    _, dequantized, reason = quantize_int4_weight(weight[:1])
    return reason is None and dequantized is not None and torch.equal(dequantized, weight[:1])


class LinearBase(nn.Module):
    """A weight ``[out_features, in_features]`` and optional bias; ``forward`` is ``x @ W.T + b``.

    After loading, ``quantize_weights("int8" | "int4")`` (opt-in) replaces the weight by its quantized
    rounding and keeps the quantized copy for small batches; ``prepare_for_inference`` may keep a
    CPU-packed copy of the weight (bfloat16 on oneDNN builds). Both must be called again whenever the
    weight changes.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        )
        self.packed_weight: PackedWeight | None = None
        self.int8_weight: torch.Tensor | None = None  # [out_features, in_features] int8
        self.int8_scales: torch.Tensor | None = None  # [out_features]
        self.int4_weight: Int4Weight | None = None
        self.q8_weight: Q8Weight | None = None  # exact 8-bit groups (layers/q8.py), small steps
        # Exact groups of 4- or 5-bit levels (a GGUF's Q4_K or Q5_0 tensor: layers/level_sums.py), small steps.
        self.level_weight: LevelWeight | None = None
        # Deterministic mode (layers/batch_invariant.py invariant_product): a batch-invariant row kernel,
        # or products on multiples of this many rows through the float weight; 0 (the default) lets
        # each batch take its fastest kernel.
        self.row_tile = 0

    def quantize_weights(self, kind: str, lossless_only: bool = False) -> str | None:
        """Weight-only quantization (``int8``: layers/quantization.py, ``int4``: layers/int4.py); the
        float weight becomes the dequantized one so every path computes with the same values. Returns
        None, or why this layer keeps its weights (int4 needs ``in_features`` divisible by 32).

        ``lossless_only`` (int4): keep the int4 copy only if it holds exactly the current weight (a
        weight loaded from 4-bit groups), leaving the weight untouched; otherwise change nothing.
        """
        if kind == "int4":
            if lossless_only and not _first_row_is_int4(self.weight.data):
                return "its values are not exactly 4-bit groups"  # cheap test before the whole weight
            int4_weight, dequantized, reason = quantize_int4_weight(self.weight.data)
            if reason is not None or dequantized is None:
                return reason
            if lossless_only:
                if not torch.equal(dequantized, self.weight.data):
                    return "its values are not exactly 4-bit groups"
            else:
                self.weight.data.copy_(dequantized)  # lossless: the weight already holds these values
            self.int4_weight = int4_weight
            return None
        assert kind == "int8", kind
        self.int8_weight, self.int8_scales = quantize_int8_rows(self.weight.data)
        self.weight.data.copy_(dequantize_int8_rows(self.int8_weight, self.int8_scales))
        return None

    def keep_exact_q8(self) -> bool:
        """Give small steps the 8-bit kernel when the weight is exactly 8-bit groups of small levels
        (a Q8_0 or Q5_0 GGUF tensor: ``q8.exact_small_level_groups``) and has no int4/int8 copy; the
        weight is unchanged. Groups whose levels all fit five bits (Q5_0) in a bfloat16 layer take the
        level-sums kernel instead where it runs (``level_sums.five_bit_weight``: 5.5 bits a weight,
        up to 8 rows). Returns whether it kept either."""
        if self.int4_weight is not None or self.int8_weight is not None:
            return False
        self.q8_weight = exact_q8_weight(self.weight.data, exact_small_level_groups)
        if self.q8_weight is not None and self.weight.dtype == torch.bfloat16 and int4_pairs_available():
            five = five_bit_weight(self.q8_weight.q, self.q8_weight.scales)
            if five is not None:
                self.level_weight, self.q8_weight = five, None
        return self.q8_weight is not None or self.level_weight is not None

    def prepare_for_inference(self) -> None:
        self.packed_weight = pack_weight(self.weight.data) if packing_available(self.weight) else None

    def onednn_packed_bf16(self) -> torch.Tensor | None:
        """The oneDNN-packed bfloat16 weight that ``_matmul`` multiplies a bfloat16 step by once the
        step has more rows than every small-step kernel of the layer takes (what the fused stacks'
        wide variants call for such steps), or None when such steps go elsewhere (row tiles, int8
        rows, float32 panels, no packing)."""
        packed = self.packed_weight
        if (
            self.row_tile
            or self.int8_weight is not None
            or self.weight.dtype != torch.bfloat16
            or packed is None
            or packed.panels
        ):
            return None
        return packed.data

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.row_tile:
            float_matmul = lambda rows: self._float_matmul(rows, bias)  # noqa: E731
            return invariant_product(x, self.weight, bias, float_matmul, self.row_tile, int4=self.int4_weight)
        if self.int4_weight is not None and self.int4_weight.takes(x):
            return self.int4_weight.linear(x, bias)
        if self.q8_weight is not None and self.q8_weight.takes(x):
            out = self.q8_weight.linear(x)  # [rows, out_features]
            return out if bias is None else out + bias
        if self.level_weight is not None and self.level_weight.takes(x):
            out = self.level_weight.linear(x)  # [rows, out_features]
            return out if bias is None else out + bias
        if self.int8_weight is not None and self.int8_scales is not None and int8_rows(x, self.int8_scales):
            return int8_linear(x, self.int8_weight, self.int8_scales, bias)
        return self._float_matmul(x, bias)

    def _float_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` with the float weight (packed where it can be; a step of one or two
        bfloat16 rows on the row kernel, ``cpu_gemm.bf16_row_linear``)."""
        if self.packed_weight is not None:
            small = bf16_row_linear(x, self.weight)
            if small is not None:
                return small if bias is None else small + bias
        if self.packed_weight is not None and x.dim() == 2 and x.dtype == self.weight.dtype and x.shape[0]:
            return packed_linear(x, self.packed_weight, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across tensor-parallel ranks (no communication in forward)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        tp: TensorParallel = SINGLE,
    ) -> None:
        features = tp.even_range(out_features, "output features")
        super().__init__(in_features, features[1], bias, dtype)
        self.tp = tp
        self.features = features  # (first, count) of the output features this rank computes

    @property
    def tp_size(self) -> int:
        return self.tp.size

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        target = self.weight if name == "weight" else self.bias
        assert target is not None, f"unexpected {name}"
        target.data.copy_(_shard(tensor, 0, self.features))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial outputs are summed with an all-reduce (the
    bias, whole on every rank, is added once after it). ``in_range`` ``(first, count)`` names this
    rank's input features when they are not an even split (the output of unevenly split heads)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        tp: TensorParallel = SINGLE,
        in_range: tuple[int, int] | None = None,
    ) -> None:
        features = in_range or tp.even_range(in_features, "input features")
        super().__init__(features[1], out_features, bias, dtype)
        self.tp = tp
        self.features = features

    @property
    def tp_size(self) -> int:
        return self.tp.size

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        if name == "weight":
            self.weight.data.copy_(_shard(tensor, 1, self.features))
        else:
            assert self.bias is not None, f"unexpected {name}"
            self.bias.data.copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._matmul(x, self.bias)
        return self.reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before the all-reduce and the bias (a LoRA delta of this
        rank's input features is added to it: ``layers/lora.py``)."""
        return self._matmul(x, None)  # [num_tokens, out_features]

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The ranks' ``partial`` outputs summed, plus the bias."""
        out = self.tp.all_reduce(partial)  # [num_tokens, out_features]
        return out if self.bias is None else out + self.bias


class MergedColumnLinear(LinearBase):
    """Several column-parallel projections of the same input in one weight.

    ``shard_sizes`` maps each checkpoint shard name (``q``, ``k``, ``v`` or ``gate``, ``up``) to its
    full output width; ``load_shard`` places this rank's rows of a checkpoint tensor. A rank keeps an
    even ``1 / tp.size`` of each shard, unless ``shard_ranges`` names its rows ``(first, count)``: the
    heads of ``TensorParallel.head_ranges``, uneven or replicated.
    """

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        tp: TensorParallel = SINGLE,
        shard_ranges: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        ranges = {name: tp.even_range(size, f"{name} features") for name, size in shard_sizes.items()}
        ranges |= shard_ranges or {}
        offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for shard_name, (_, count) in ranges.items():
            offsets[shard_name] = (offset, count)
            offset += count
        super().__init__(in_features, offset, bias, dtype)
        self.shard_ranges = ranges
        self.full_sizes = dict(shard_sizes)
        self.shard_offsets = offsets
        self.tp = tp

    @property
    def tp_size(self) -> int:
        return self.tp.size

    def load_shard(self, shard_name: str, param_name: str, tensor: torch.Tensor) -> None:
        offset, size = self.shard_offsets[shard_name]
        target = self.weight if param_name == "weight" else self.bias
        assert target is not None, f"unexpected {param_name}"
        target.data.narrow(0, offset, size).copy_(_shard(tensor, 0, self.shard_ranges[shard_name]))

    def load_fused(self, param_name: str, tensor: torch.Tensor) -> None:
        """Load a checkpoint tensor that already holds every shard stacked (Phi-3's qkv_proj)."""
        full_sizes = list(self.full_sizes.values())
        if tensor.shape[0] != sum(full_sizes):
            raise ValueError(f"fused {param_name} has {tensor.shape[0]} rows, expected {sum(full_sizes)}")
        for shard_name, part in zip(self.full_sizes, tensor.split(full_sizes, dim=0)):
            self.load_shard(shard_name, param_name, part)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        """Cut this layer's output back into its shards, in construction order."""
        return list(out.split([size for _, size in self.shard_offsets.values()], dim=-1))


def head_rows(
    first_q: int, num_q: int, first_kv: int, num_kv: int, head_dim: int
) -> dict[str, tuple[int, int]]:
    """A merged QKV layer's ``shard_ranges`` for the heads ``TensorParallel.head_ranges`` gave."""
    kv = (first_kv * head_dim, num_kv * head_dim)
    return {"q": (first_q * head_dim, num_q * head_dim), "k": kv, "v": kv}
