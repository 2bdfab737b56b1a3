"""Token embedding and the LM head (which may share the embedding's weight), vocabulary-parallel.

Under tensor parallelism each rank holds ``ceil(vocab_size / tp.size)`` consecutive rows of the
table (the last rank's tail is zero padding). The embedding looks up the ids in its range, zeroes the
others and sums over ranks; the head projects onto its rows and rank 0 gathers every rank's columns
into the full logits (the other ranks get an empty ``[rows, 0]``: only rank 0 samples).
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
from tokenmill.layers.q8 import Q8Weight, exact_q8_weight
from tokenmill.layers.quantization import dequantize_int8_rows, int8_linear, int8_rows, quantize_int8_rows
from tokenmill.layers.tensor_parallel import SINGLE, TensorParallel


class VocabEmbedding(nn.Module):
    """Embedding table ``[vocab_size, hidden_size]``, or this rank's ``rows_per_rank`` rows of it."""

    def __init__(
        self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.first_row = tp.rank * self.rows_per_rank
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_rank, hidden_size, dtype=dtype), requires_grad=False
        )

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(token_ids, self.weight)  # [num_tokens, hidden_size]
        local = token_ids - self.first_row  # [num_tokens]
        outside = (local < 0) | (local >= self.rows_per_rank)
        embedded = F.embedding(local.masked_fill(outside, 0), self.weight)  # [num_tokens, hidden_size]
        embedded.masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(embedded)  # [num_tokens, hidden_size]

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        load_vocab_rows(self.weight, tensor, self.vocab_size, self.tp)


def load_vocab_rows(weight: torch.Tensor, tensor: torch.Tensor, vocab_size: int, tp: TensorParallel) -> None:
    """Copy this rank's rows of the checkpoint table ``tensor`` ``[vocab_size, hidden]`` into
    ``weight`` ``[rows_per_rank, hidden]``, zero past the vocabulary's end."""
    if tp.size == 1:
        weight.data.copy_(tensor)
        return
    if tensor.shape[0] != vocab_size:
        raise ValueError(f"vocabulary table has {tensor.shape[0]} rows, expected {vocab_size}")
    rows_per_rank = weight.shape[0]
    rows = tensor[tp.rank * rows_per_rank : (tp.rank + 1) * rows_per_rank]
    weight.data[: rows.shape[0]].copy_(rows)
    weight.data[rows.shape[0] :].zero_()


class LMHead(nn.Module):
    """Projects hidden states to logits in the activation dtype (the sampler upcasts to float32 where it
    needs to; a greedy step does not); ``tied_to`` shares an embedding's weight."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        tied_to: VocabEmbedding | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.tied_to = tied_to
        self.tp = tp
        self.vocab_size = vocab_size
        # The head's rows follow the embedding's split (a tied head shares its table).
        self.rows_per_rank = -(-vocab_size // tp.size)
        if tied_to is None:
            self.weight = nn.Parameter(
                torch.empty(self.rows_per_rank, hidden_size, dtype=dtype), requires_grad=False
            )

        self.packed_weight: PackedWeight | None = None
        self.int8_weight: torch.Tensor | None = None
        self.int8_scales: torch.Tensor | None = None
        self.dequantized_weight: torch.Tensor | None = None
        self.q8_weight: Q8Weight | None = None
        self.row_tile = 0  # deterministic mode: see LinearBase.row_tile

    def quantize_weights(self, kind: str) -> str | None:
        """Int8 projection weights (layers/quantization.py); under int4 the head keeps its weights. The
        float weight is left alone (a tied one is also the embedding table, which stays exact); large
        batches project with a dequantized copy, so every batch size computes logits with the same
        quantized values. Returns None, or why the projection keeps its weights."""
        weight = self._own_weight()
        if kind == "int4":
            # 4 bits are too coarse for the logits: on SmolLM2 an int4 head alone raised perplexity
            # 4.7% while int4 decoder layers left it unchanged (docs/performance.md), and GGUF's own
            # Q4 files keep the head at 8 bits. The head stays exact; it costs ~1.6 ms per token.
            return "the LM head stays in its float dtype under int4 (4-bit logits cost 4.7% perplexity)"
        assert kind == "int8", kind
        self.int8_weight, self.int8_scales = quantize_int8_rows(weight.data)
        self.dequantized_weight = dequantize_int8_rows(self.int8_weight, self.int8_scales)
        return None

    def keep_exact_q8(self) -> bool:
        """Give the projection the exact 8-bit groups of its weight when it has them (a Q8_0 GGUF
        tensor: layers/q8.py), for steps of up to ``Q8_MAX_ROWS`` rows; the weight itself is unchanged. Returns
        whether it did."""
        if self.int8_weight is not None:
            return False
        self.q8_weight = exact_q8_weight(self._projection_weight().data)
        return self.q8_weight is not None

    def _projection_weight(self) -> torch.Tensor:
        if self.dequantized_weight is not None:
            return self.dequantized_weight
        return self._own_weight()

    def _own_weight(self) -> torch.Tensor:
        return self.tied_to.weight if self.tied_to is not None else self.weight

    def prepare_for_inference(self) -> None:
        """Keep a CPU-packed copy of the projection (see layers/cpu_gemm.py); redo after weight changes."""
        weight = self._projection_weight()
        self.packed_weight = pack_weight(weight.data) if packing_available(weight) else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[num_rows, vocab_size]``; under tensor parallelism only on rank 0 (the other
        ranks get ``[num_rows, 0]``). The deterministic mode projects on a batch-invariant row kernel or in
        row tiles (``row_tile``, ``batch_invariant.invariant_product``)."""
        if self.row_tile:
            weight = self._projection_weight()
            local = invariant_product(
                hidden, weight, None, self._float_projection, self.row_tile, q8=self.q8_weight
            )  # [num_rows, rows_per_rank]
        else:
            local = self._project(hidden)  # [num_rows, rows_per_rank]
        if self.tp.size == 1:
            return local
        if local.shape[0] == 0:  # every rank has the same rows: none of them gathers
            return local.new_empty(0, self.vocab_size if self.tp.is_first else 0)
        full = self.tp.gather_columns(local)  # [num_rows, tp.size * rows_per_rank] on rank 0
        if full is None:
            return local[:, :0]
        return full[:, : self.vocab_size]  # the last rank's padding dropped

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        if (
            self.int8_weight is not None
            and self.int8_scales is not None
            and int8_rows(hidden, self.int8_scales)
        ):
            return int8_linear(hidden, self.int8_weight, self.int8_scales, None)  # [num_rows, vocab]
        if self.q8_weight is not None and self.q8_weight.takes(hidden):
            return self.q8_weight.linear(hidden)  # [num_rows, vocab_size]
        return self._float_projection(hidden)

    def _float_projection(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits through the float (or int8-dequantized) weight, packed where it can be (a step
        of one or two bfloat16 rows on the row kernel, ``cpu_gemm.bf16_row_linear``)."""
        if self.packed_weight is not None:
            small = bf16_row_linear(hidden, self._projection_weight())
            if small is not None:
                return small  # [num_rows, vocab_size]
        if (
            self.packed_weight is not None
            and hidden.dtype == self.packed_weight.dtype
            and hidden.shape[0] > 0
        ):
            return packed_linear(hidden, self.packed_weight, None)  # [num_rows, vocab_size]
        return F.linear(hidden, self._projection_weight())  # [num_rows, vocab_size]

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        if self.tied_to is not None:
            return  # checkpoints of tied models sometimes carry a copy; the embedding is the source
        load_vocab_rows(self.weight, tensor, self.vocab_size, self.tp)
