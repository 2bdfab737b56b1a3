"""EAGLE draft heads over a Llama-family target, in the published checkpoint layouts.

EAGLE-1 (``fc.weight [H, 2H]`` with a bias, ``layers.0.*``: one Llama decoder layer without its input
norm): ``h' = layer(fc([embed(t_{p+1}); f_p]))`` from the target's final hidden state ``f_p``; the
target's LM head turns ``h'`` into the next token.

EAGLE-3 (``fc.weight [H, 3H]``, ``midlayer.*`` with its ``hidden_norm``, ``norm``, ``lm_head [draft_vocab, H]``, ``d2t``): the
features are three target layers' inputs concatenated (low, middle, high), projected by ``fc``; the
decoder layer attends over ``[input_norm(embed); hidden_norm(h)]`` (``2H`` wide), and its output,
normed, gives logits over a reduced draft vocabulary (draft id ``i`` is target id ``i + d2t[i]``).
Chained drafts feed the head's own ``H``-wide output back without ``fc``. An EAGLE-1 head may also
carry ``lm_head [draft_vocab, H]`` and ``d2t`` (as ``tokenmill train-eagle`` writes it): it then
drafts over that reduced vocabulary, a few % of a target step's LM head.

Weights come from ``model.safetensors`` or, failing that, ``pytorch_model.bin`` through
``torch.load(weights_only=True)``. The head's embedding is the target's (a checkpoint's own copy is
checked for shape and not loaded).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import cast

import torch
import transformers
from torch import nn

from tokenmill.layers.attention.backend import AttentionBackend
from tokenmill.layers.forward_batch import ForwardBatch
from tokenmill.layers.linear import ColumnParallelLinear, RowParallelLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import get_rope
from tokenmill.models.llama import LlamaArgs, LlamaDecoderLayer, LlamaForCausalLM
from tokenmill.models.weights import load_hf_weights


def read_head_checkpoint(folder: str) -> tuple[transformers.LlamaConfig, dict[str, torch.Tensor]]:
    """The head's config and tensors from ``folder`` (``config.json`` and safetensors, or a .bin
    loaded with ``weights_only=True``); ValueError when either is missing."""
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"EAGLE head folder {folder!r} has no config.json")
    with open(config_path) as f:
        raw = json.load(f)
    raw.pop("architectures", None)
    raw.pop("model_type", None)
    config = transformers.LlamaConfig(**raw)
    safetensors_path = os.path.join(folder, "model.safetensors")
    bin_path = os.path.join(folder, "pytorch_model.bin")
    if os.path.isfile(safetensors_path):
        from safetensors.torch import load_file

        tensors = load_file(safetensors_path)
    elif os.path.isfile(bin_path):
        tensors = torch.load(bin_path, map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"EAGLE head folder {folder!r} has neither model.safetensors nor pytorch_model.bin")
    return config, tensors


def head_layout(tensors: dict[str, torch.Tensor]) -> str:
    """``eagle`` or ``eagle3``: which published layout the tensors are in."""
    if "midlayer.self_attn.q_proj.weight" in tensors:
        return "eagle3"
    if "layers.0.self_attn.q_proj.weight" in tensors:
        return "eagle"
    raise ValueError(
        "the EAGLE head checkpoint has neither 'layers.0.*' (EAGLE-1) nor 'midlayer.*' (EAGLE-3) tensors"
    )


class EagleHead(nn.Module):
    """An EAGLE-1 or EAGLE-3 head (see the module docstring); ``forward`` and ``compute_logits`` are
    the ``DraftHead`` contract of ``worker/hidden_drafter.py``."""

    def __init__(
        self,
        config: transformers.LlamaConfig,
        tensors: dict[str, torch.Tensor],
        target: LlamaForCausalLM,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.layout = head_layout(tensors)
        self.eagle3 = self.layout == "eagle3"
        args = LlamaArgs.from_hf(config)
        hidden = args.hidden_size
        if hidden != target.args.hidden_size:
            raise ValueError(
                f"the EAGLE head's hidden size is {hidden}, the target's {target.args.hidden_size}: "
                "the head was trained for another model"
            )
        if args.vocab_size != target.args.vocab_size:
            raise ValueError(
                f"the EAGLE head's vocabulary has {args.vocab_size} tokens, the target's "
                f"{target.args.vocab_size}: the head was trained for another model"
            )
        self.hidden_size = hidden
        fc = tensors["fc.weight"]  # [H, num_features * H]
        num_features = 3 if self.eagle3 else 1
        if fc.shape[1] != (num_features + (0 if self.eagle3 else 1)) * hidden:
            raise ValueError(
                f"the EAGLE head's fc.weight is {list(fc.shape)}, which does not fit hidden size {hidden}"
            )
        self.feature_size = num_features * hidden
        self.fc = ColumnParallelLinear(fc.shape[1], hidden, bias="fc.bias" in tensors, dtype=dtype)
        rotary = get_rope(config, args.head_dim)
        layer = LlamaDecoderLayer(dataclasses.replace(args, num_layers=1), rotary, dtype)
        if self.eagle3:  # attention reads [embed; hidden], 2H wide, and writes H
            wide = LlamaDecoderLayer(dataclasses.replace(args, hidden_size=2 * hidden), rotary, dtype)
            layer.self_attn = wide.self_attn
            layer.self_attn.o_proj = RowParallelLinear(args.num_heads * args.head_dim, hidden, dtype=dtype)
            layer.hidden_norm = RMSNorm(hidden, args.rms_norm_eps)  # type: ignore[assignment]
            self.norm = RMSNorm(hidden, args.rms_norm_eps)
            self.midlayer = layer
        else:  # EAGLE-1's only layer has no input norm
            layer.input_layernorm = nn.Identity()  # type: ignore[assignment]
            self.layers = nn.ModuleList([layer])
        # Its own LM head over a draft vocabulary (EAGLE-3; an EAGLE-1 head trained here), else the target's.
        self.own_head = "lm_head.weight" in tensors
        if self.own_head:
            draft_vocab = int(tensors["lm_head.weight"].shape[0])
            self.lm_head = ColumnParallelLinear(hidden, draft_vocab, dtype=dtype)
            d2t = tensors.get("d2t")
            if d2t is not None and d2t.shape[0] != draft_vocab:
                raise ValueError(
                    f"the EAGLE head's d2t has {d2t.shape[0]} entries, its draft vocabulary {draft_vocab}"
                )
            offsets = d2t if d2t is not None else torch.zeros(draft_vocab, dtype=torch.long)
            d2t_ids = torch.arange(draft_vocab) + offsets.long()  # [draft_vocab] target ids
            self.register_buffer("d2t_ids", d2t_ids, persistent=False)
            if int(d2t_ids.max()) >= args.vocab_size or int(d2t_ids.min()) < 0:
                raise ValueError("the EAGLE head's d2t maps draft ids outside the target's vocabulary")
        elif self.eagle3:
            raise ValueError("the EAGLE-3 head checkpoint has no lm_head.weight")
        self.layer = layer
        # The target's embedding and LM head, not registered here (no second copy).
        self._target = (target.embed_tokens, target.lm_head)
        self._load(tensors, target)
        self.to(dtype)
        self.eval()

    @property
    def draft_to_target(self) -> torch.Tensor | None:
        return cast(torch.Tensor, self.d2t_ids) if self.own_head else None

    @property
    def attention_backend(self) -> type[AttentionBackend]:
        return type(self.layer.self_attn.attn)

    def _load(self, tensors: dict[str, torch.Tensor], target: LlamaForCausalLM) -> None:
        own = {}
        for name, tensor in tensors.items():
            if name in ("d2t", "t2d"):
                continue
            if name.removeprefix("model.") == "embed_tokens.weight":
                if tuple(tensor.shape) != (target.args.vocab_size, self.hidden_size):
                    raise ValueError(
                        f"the EAGLE head's embed_tokens is {list(tensor.shape)}: another model's"
                    )
                continue
            own[name] = tensor
        load_hf_weights(self, own.items())

    def forward(
        self, previous: torch.Tensor, next_token_ids: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """The head's hidden state ``[num_tokens, hidden_size]`` from the previous features
        (``feature_size`` wide from the target, ``hidden_size`` wide from the head itself) and the
        next tokens; its KV is ``batch.kv_caches[0]``."""
        embedding = self._target[0](next_token_ids)  # [num_tokens, hidden_size]
        if not self.eagle3:
            hidden = self.fc(torch.cat([embedding, previous], dim=-1))  # [T, H]
            out, residual = self.layer(hidden, None, batch, 0)
            return out + residual  # [num_tokens, hidden_size]
        hidden = self.fc(previous) if previous.shape[-1] != self.hidden_size else previous  # [T, H]
        layer = self.midlayer
        joined = torch.cat(
            [layer.input_layernorm(embedding), cast(RMSNorm, layer.hidden_norm)(hidden)], dim=-1
        )  # [T, 2H]
        hidden = hidden + layer.self_attn(joined, batch, 0)  # [T, H]
        normed, residual = layer.post_attention_layernorm(hidden, None), hidden
        return residual + layer.mlp(normed)  # [num_tokens, hidden_size]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[rows, draft_vocab]`` (EAGLE-3) or ``[rows, vocab_size]`` through the target's LM head."""
        if self.eagle3:
            return self.lm_head(self.norm(hidden))
        if self.own_head:  # the features it was trained to predict are normed already
            return self.lm_head(hidden)
        return self._target[1](hidden)


def eagle3_aux_layers(config: transformers.LlamaConfig, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs EAGLE-3 reads, in order: the head config's
    ``eagle_aux_hidden_state_layer_ids`` (top level or in ``eagle_config``), else low, middle and
    high as the published heads (``2, N // 2, N - 3``)."""
    nested = getattr(config, "eagle_config", None) or {}
    ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None) or nested.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    if num_target_layers < 3:
        raise ValueError(f"EAGLE-3 needs a target of at least 3 layers, this one has {num_target_layers}")
    layers = (
        tuple(sorted(int(i) for i in ids))
        if ids
        else tuple(sorted((2, num_target_layers // 2, num_target_layers - 3)))
    )
    if len(layers) != 3 or not all(0 <= i < num_target_layers for i in layers):
        raise ValueError(
            f"EAGLE-3 reads three target layers within 0..{num_target_layers - 1}, not {list(layers)}"
        )
    return layers
