"""The explicit per-step input of ``model.forward``: token ids, positions and paged-attention metadata.

Built once per step by the model runner and shared by every layer; nothing about the current batch
lives in globals.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.layers.attention.metadata import AttentionGroup, AttentionMetadata, DecodesAndChunks
from tokenmill.layers.lora import LoRABatch
from tokenmill.layers.recurrent_state import RecurrentBatch
from tokenmill.step_control import NEVER_STOP, LayerProgress, StepControl

# Re-exported: these lived here before the backends owned their metadata.
__all__ = ["AttentionGroup", "AttentionMetadata", "DecodesAndChunks", "ForwardBatch", "LayerProgress"]


@dataclass
class ForwardBatch:
    """One step's input for ``model.forward``.

    ``seq_lens`` gives, per token, the length of its sequence after this step (dynamic rope needs
    it). ``kv_caches[layer]`` is that layer's paged cache ``[2, num_blocks, block_size, kv_heads,
    head_dim]``. ``logits_rows`` selects the token rows whose logits the caller needs.

    ``attn`` is the attention metadata for the model's uniform window (None: full attention, or
    Mistral's window on every layer). Models whose layers differ (Gemma 3 interleaves sliding and
    global layers) ask ``attention(window)`` for their layer's; the attention backend builds one
    metadata per distinct window the model declares in ``layer_sliding_windows``
    (``AttentionBackend.build_metadata``). A model's layer loop asks ``control.should_stop(layer)``
    before each layer and returns a ``LayerProgress`` when it says stop.
    """

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    seq_lens: torch.Tensor  # [num_tokens] int64
    attn: AttentionMetadata
    kv_caches: list[torch.Tensor]
    logits_rows: torch.Tensor  # [num_logit_rows] int64
    attn_by_window: dict[int | None, AttentionMetadata] = field(default_factory=dict)
    # Asked between layers whether to stop the step (step_control.py); NEVER_STOP for steps that
    # may not be stopped.
    control: StepControl = NEVER_STOP
    # Where a paused pass goes on (the model skips the embedding and the layers before it).
    resume_from: LayerProgress | None = None
    # Which LoRA slot each row uses (layers/lora.py); None when no row uses an adapter.
    lora: LoRABatch | None = None
    # Recurrent-state slots and checkpoints of the sequences (linear-attention models); None otherwise.
    recurrent: RecurrentBatch | None = None
    # Layers whose input hidden state (the residual stream) a drafter reads (EAGLE-3), and where the
    # forward appends them, ``[num_tokens, hidden_size]`` each, in layer order; () captures nothing.
    aux_layers: tuple[int, ...] = ()
    aux_hidden: list[torch.Tensor] = field(default_factory=list)

    def attention(self, sliding_window: int | None) -> AttentionMetadata:
        """The metadata for layers attending over ``sliding_window`` trailing positions (None: all)."""
        metadata = self.attn_by_window.get(sliding_window)
        if metadata is None and all(g.sliding_window == sliding_window for g in self.attn.groups):
            metadata = self.attn  # a batch built for one window only
        if metadata is None:
            raise ValueError(
                f"no attention metadata for sliding window {sliding_window}; the batch has "
                f"{sorted(self.attn_by_window, key=lambda w: -1 if w is None else w)}"
            )
        return metadata

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
