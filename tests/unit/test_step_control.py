"""Step control in the layers: a model's layer loop asks ``batch.control.should_stop`` before each
layer and, when told to stop, returns a ``LayerProgress`` (nothing raised); a pass resumed from it
gives the uninterrupted pass's bits, and the resumed pass runs its first layer before it may stop."""

from __future__ import annotations

import pytest
import torch
import transformers

from tokenmill.layers.attention import SequenceStep, TorchReferenceBackend
from tokenmill.layers.forward_batch import ForwardBatch
from tokenmill.models.gemma3 import Gemma3ForCausalLM
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.step_control import LayerProgress, StepControl

BLOCK_SIZE, NUM_BLOCKS = 4, 8


class StopBefore(StepControl):
    """Says stop before ``layer`` once, as a raised flag would (without a flag file)."""

    def __init__(self, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.asked: list[int] = []

    def should_stop(self, next_layer: int) -> bool:
        self.asked.append(next_layer)
        if next_layer != self.layer:
            return False
        self.layer = -1
        return True


def _tiny(arch: str) -> LlamaForCausalLM | Gemma3ForCausalLM:
    common = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    if arch == "llama":
        model: LlamaForCausalLM | Gemma3ForCausalLM = LlamaForCausalLM(
            transformers.LlamaConfig(**common), torch.float32
        )
    else:
        config = transformers.Gemma3TextConfig(**common, sliding_window=4, query_pre_attn_scalar=8)
        model = Gemma3ForCausalLM(config, torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return model.eval()


def _batch(model: LlamaForCausalLM | Gemma3ForCausalLM) -> ForwardBatch:
    """A prompt of 5 tokens on blocks [3, 1] and a decode at position 2 on block [5]."""
    sequences = [SequenceStep(0, 0, 5, [3, 1]), SequenceStep(5, 2, 1, [5])]
    positions = [0, 1, 2, 3, 4, 2]
    slots = torch.tensor([12, 13, 14, 15, 4, 22])
    metadata = TorchReferenceBackend.build_metadata(sequences, slots, BLOCK_SIZE, model.layer_sliding_windows)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    return ForwardBatch(
        input_ids=torch.tensor([5, 9, 2, 7, 11, 3]),
        positions=torch.tensor(positions),
        seq_lens=torch.tensor([5] * 5 + [3]),
        attn=metadata.get(model.sliding_window) or next(iter(metadata.values())),
        kv_caches=[torch.zeros(shape) for _ in range(model.num_layers)],
        logits_rows=torch.tensor([4, 5]),
        attn_by_window=metadata,
    )


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_layer_loop_returns_its_progress_when_the_control_says_stop(arch: str) -> None:
    model = _tiny(arch)
    with torch.inference_mode():
        whole = model(_batch(model))  # [num_tokens, hidden_size]
        assert isinstance(whole, torch.Tensor)

        batch = _batch(model)
        batch.control = control = StopBefore(2)
        progress = model(batch)
        assert isinstance(progress, LayerProgress) and progress.next_layer == 2
        assert (progress.residual is None) == (arch == "gemma3")  # Gemma 3's stream is `hidden` itself
        assert control.asked == [0, 1, 2]
        stopped = _batch(model)
        stopped.control = StopBefore(1)
        assert isinstance(model.forward_logits(stopped), LayerProgress)  # the model interface passes it on

        batch.resume_from = progress
        batch.control = StopBefore(-1)
        assert torch.equal(model(batch), whole)
        logits = model.forward_logits(_batch(model))
        assert isinstance(logits, torch.Tensor) and logits.shape == (2, 64)
