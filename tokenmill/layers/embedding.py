"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.cpu_gemm import pack_weight, packed_linear, packing_available


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
    """Projects hidden states to float32 logits; ``tied_to`` shares an embedding's weight."""

    def __init__(
        self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tied_to: VocabEmbedding | None = None
    ) -> None:
        super().__init__()
        self.tied_to = tied_to
        if tied_to is None:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

        self.packed_weight: torch.Tensor | None = None

    def prepare_for_inference(self) -> None:
        """Keep a CPU-packed copy of the projection (see layers/cpu_gemm.py); redo after weight changes."""
        weight = self.tied_to.weight if self.tied_to is not None else self.weight
        self.packed_weight = pack_weight(weight.data) if packing_available(weight) else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None and hidden.dtype == torch.bfloat16 and hidden.shape[0] > 0:
            return packed_linear(hidden, self.packed_weight, None).float()  # [num_rows, vocab_size]
        weight = self.tied_to.weight if self.tied_to is not None else self.weight
        return F.linear(hidden, weight).float()  # [num_rows, vocab_size]

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        if self.tied_to is not None:
            return  # checkpoints of tied models sometimes carry a copy; the embedding is the source
        self.weight.data.copy_(tensor)
