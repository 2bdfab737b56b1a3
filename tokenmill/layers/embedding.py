"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.batch_invariant import row_tiled
from tokenmill.layers.cpu_gemm import PackedWeight, pack_weight, packed_linear, packing_available
from tokenmill.layers.q8 import Q8Weight, exact_q8_weight
from tokenmill.layers.quantization import dequantize_int8_rows, int8_linear, int8_rows, quantize_int8_rows


class VocabEmbedding(nn.Module):
    """Embedding table ``[vocab_size, hidden_size]``.

    Vocabulary parallelism is the natural next step for tensor parallelism; with one rank the whole
    table lives here.
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)  # [num_tokens, hidden_size]

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        self.weight.data.copy_(tensor)


class LMHead(nn.Module):
    """Projects hidden states to logits in the activation dtype (the sampler upcasts to float32 where it
    needs to; a greedy step does not); ``tied_to`` shares an embedding's weight."""

    def __init__(
        self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tied_to: VocabEmbedding | None = None
    ) -> None:
        super().__init__()
        self.tied_to = tied_to
        if tied_to is None:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

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
        weight = self.tied_to.weight if self.tied_to is not None else self.weight
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
        return self.tied_to.weight if self.tied_to is not None else self.weight

    def prepare_for_inference(self) -> None:
        """Keep a CPU-packed copy of the projection (see layers/cpu_gemm.py); redo after weight changes."""
        weight = self._projection_weight()
        self.packed_weight = pack_weight(weight.data) if packing_available(weight) else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.row_tile:
            return row_tiled(self._float_projection, hidden, self.row_tile)  # [num_rows, vocab_size]
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
        """The logits through the float (or int8-dequantized) weight, packed where it can be."""
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
        self.weight.data.copy_(tensor)
