"""The transformers fallback: any ``AutoModelForCausalLM`` architecture over our paged KV cache.

transformers' own modelling code runs the layers; only attention is ours. We register an attention
function under ``ATTENTION_NAME`` in transformers' ``AttentionInterface`` and load the model with
``attn_implementation=ATTENTION_NAME``. Every attention module then hands us its query, key and value
(``[1, heads, num_tokens, head_dim]``); we write K/V into the layer's paged cache at the step's slot
mapping and attend through our attention backend, exactly as a native model does.

The batch is flattened as the model runner builds it: all tokens of all sequences in one row, with
explicit ``position_ids``, so continuous batching, chunked prefill and prefix caching work unchanged.
The step's ``ForwardBatch`` reaches the attention function through the keyword arguments transformers
forwards from the model's ``forward`` to every attention call (``PAGED_KWARG``); there is no global.

At load, a probe forward checks that the architecture really routes every layer's attention through
the interface, forwards our keyword argument, and asks for nothing we cannot give (a model-built
mask or position bias, logit soft-capping, attention sinks, non-causal attention, per-layer sliding
windows, values wider than keys, sequence-length-dependent RoPE). Values narrower than keys (DeepSeek's
multi-head latent attention, expanded) are zero-padded to the keys' width in the cache and the
padding is cut from the output. Anything else is a
``ValueError`` at start-up naming the reason, never a model that runs wrong.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from torch import nn

from tokenmill.layers.attention import AttentionBackend, select_backend
from tokenmill.layers.forward_batch import ForwardBatch
from tokenmill.models.base import CausalLM

ATTENTION_NAME = "tokenmill_paged"
PAGED_KWARG = "tokenmill_paged"  # the keyword argument that carries a PagedAttentionCall
# RoPE variants whose frequencies depend on the sequence length; transformers takes it from the
# largest position id in the row, which in a flattened batch is another sequence's.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass
class PagedAttentionCall:
    """What one forward step's attention calls need: the batch, and each layer's attention backend."""

    batch: ForwardBatch
    layers: list[AttentionBackend]


@dataclass
class _ProbedLayer:
    module: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    value_dim: int
    sliding_window: int | None


@dataclass
class _Probe:
    """Collects what the attention calls of a probe forward look like (one entry per call)."""

    calls: list[_ProbedLayer] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,  # [1, num_heads, num_tokens, head_dim]
    key: torch.Tensor,  # [1, num_kv_heads, num_tokens, head_dim]
    value: torch.Tensor,  # [1, num_kv_heads, num_tokens, head_dim]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract over our paged cache.

    Needs ``kwargs[PAGED_KWARG]``: a ``PagedAttentionCall`` (a step) or a probe. Stores the new K/V at
    the batch's slot mapping, then every token attends causally to its own sequence's cached tokens.
    Returns ``([1, num_tokens, num_heads, head_dim], None)``.
    """
    context = kwargs.get(PAGED_KWARG)
    head_dim = query.shape[-1]
    scale = scaling if scaling is not None else head_dim**-0.5
    if isinstance(context, _Probe):
        _record_probe(context, module, query, key, value, attention_mask, scale, kwargs)
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None
    if not isinstance(context, PagedAttentionCall):
        raise RuntimeError(
            f"{type(module).__name__} called the {ATTENTION_NAME!r} attention without tokenmill's batch; "
            "this architecture does not forward attention keyword arguments"
        )
    layer_index = int(module.layer_idx)  # type: ignore[arg-type]
    attention = context.layers[layer_index]
    if query.shape[0] != 1 or abs(scale - attention.scale) > 1e-12 * max(1.0, attention.scale):
        raise RuntimeError(f"layer {layer_index}: attention call differs from the one probed at load")
    q = query[0].transpose(0, 1)  # [num_tokens, num_heads, head_dim]
    k = key[0].transpose(0, 1)  # [num_tokens, num_kv_heads, head_dim]
    v = value[0].transpose(0, 1)  # [num_tokens, num_kv_heads, value_dim]
    value_dim = v.shape[-1]
    if value_dim < head_dim:  # zero columns attend to zeros: cut from the output below
        v = torch.nn.functional.pad(v, (0, head_dim - value_dim))  # [num_tokens, num_kv_heads, head_dim]
    batch = context.batch
    out = attention.forward(q, k, v, batch.kv_caches[layer_index], batch.attn)  # [num_tokens, heads, dim]
    return out[..., :value_dim].unsqueeze(0), None  # [1, num_tokens, num_heads, value_dim]


def _record_probe(
    probe: _Probe,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
    kwargs: dict[str, Any],
) -> None:
    name = type(module).__name__
    if attention_mask is not None:
        probe.problems.append(f"{name} builds its own attention mask or bias")
    if kwargs.get("position_bias") is not None:
        probe.problems.append(f"{name} adds a position bias to the attention scores")
    if kwargs.get("softcap") is not None:
        probe.problems.append(f"{name} soft-caps attention logits")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        probe.problems.append(f"{name} uses attention sinks")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        probe.problems.append(f"{name} is not causal")
    if key.shape[-1] < value.shape[-1]:
        probe.problems.append(f"{name} has values ({value.shape[-1]}) wider than its keys ({key.shape[-1]})")
    window = kwargs.get("sliding_window")
    probe.calls.append(
        _ProbedLayer(
            module=module,
            num_heads=int(query.shape[1]),
            num_kv_heads=int(key.shape[1]),
            head_dim=int(key.shape[-1]),
            scale=float(scale),
            value_dim=int(value.shape[-1]),
            sliding_window=int(window) if window else None,
        )
    )


def _rope_types(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("rope_type"), str):
            yield node["rope_type"]
        for value in node.values():
            yield from _rope_types(value)


def _check_config(config: Any, arch: str) -> None:
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{arch} is an encoder-decoder model; the transformers fallback runs decoder-only LMs"
        )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    for rope_type in _rope_types(rope):
        if rope_type in _LENGTH_DEPENDENT_ROPE:
            raise ValueError(
                f"{arch} uses {rope_type!r} RoPE, which transformers sizes from the longest sequence "
                "in a flattened batch; the transformers fallback does not support it"
            )


def _check_backend(model_class: type, arch: str) -> None:
    if not model_class.is_backend_compatible():  # type: ignore[attr-defined]
        raise ValueError(
            f"{arch} cannot run on the transformers fallback: transformers does not let "
            f"{model_class.__name__} use a custom attention function"
        )


class TransformersForCausalLM(CausalLM):
    """A transformers causal LM whose attention runs over tokenmill's paged KV cache.

    It implements the model interface (``models/base.py``) with ``forward_logits(batch)``, which
    runs the whole transformers model (its own LM head and any logit post-processing, on
    ``logits_to_keep`` rows) and returns float32 logits for ``batch.logits_rows`` only; it never stops
    between layers (transformers' loop has no place to ask ``batch.control``). ``num_layers``,
    ``num_kv_heads``, ``head_dim`` and ``sliding_window`` size and mask the KV cache; they are what
    the model's attention calls showed at load.
    """

    def __init__(
        self, hf_model: transformers.PreTrainedModel, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.hf_model = hf_model
        arch = type(hf_model).__name__
        self.architecture = arch
        layers = self._probe(hf_model, device)
        self._num_layers = len(layers)
        self._num_kv_heads = layers[0].num_kv_heads
        self._head_dim = layers[0].head_dim
        self._sliding_window = layers[0].sliding_window
        backend = select_backend(device, dtype)
        self.attention_layers = [
            backend(layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scale) for layer in layers
        ]

    def _probe(self, hf_model: transformers.PreTrainedModel, device: torch.device) -> list[_ProbedLayer]:
        """Run two tokens through the model with a recording attention and check what it saw."""
        arch = self.architecture
        probe = _Probe()
        # Not the padding id: transformers warns about a missing attention mask when it sees one.
        token = 1 if getattr(hf_model.config, "pad_token_id", None) == 0 else 0
        with torch.inference_mode():
            hf_model(
                input_ids=torch.full((1, 2), token, dtype=torch.long, device=device),
                position_ids=torch.arange(2, device=device)[None],
                use_cache=False,
                logits_to_keep=1,
                **{PAGED_KWARG: probe},
            )
        if probe.problems:
            raise ValueError(
                f"{arch} cannot run on the transformers fallback: {'; '.join(sorted(set(probe.problems)))}"
            )
        if not probe.calls:
            raise ValueError(
                f"{arch} cannot run on the transformers fallback: its attention does not go through "
                "transformers' attention interface (or it does not forward attention keyword arguments)"
            )
        indices = [getattr(call.module, "layer_idx", None) for call in probe.calls]
        if indices != list(range(len(probe.calls))):
            raise ValueError(
                f"{arch} cannot run on the transformers fallback: its attention layers report indices "
                f"{indices}, expected 0..{len(probe.calls) - 1} in order"
            )
        first = probe.calls[0]
        for call in probe.calls:
            if (call.num_kv_heads, call.head_dim, call.value_dim) != (
                first.num_kv_heads,
                first.head_dim,
                first.value_dim,
            ):
                raise ValueError(
                    f"{arch} cannot run on the transformers fallback: its layers' key/value shapes differ"
                )
        windows = {call.sliding_window for call in probe.calls}
        if len(windows) > 1:
            raise ValueError(
                f"{arch} cannot run on the transformers fallback: its layers use different attention "
                f"windows {sorted(windows, key=str)}"
            )
        layer_types = set(getattr(hf_model.config, "layer_types", None) or [])
        if windows == {None} and layer_types - {"full_attention"}:
            raise ValueError(
                f"{arch} cannot run on the transformers fallback: its config has layer types "
                f"{sorted(layer_types)} that its attention calls do not describe"
            )
        return probe.calls

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def num_kv_heads(self) -> int:
        return self._num_kv_heads

    @property
    def head_dim(self) -> int:
        return self._head_dim

    @property
    def sliding_window(self) -> int | None:
        """The attention window every layer uses (None: full attention)."""
        return self._sliding_window

    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits ``[num_logit_rows, vocab_size]`` for ``batch.logits_rows``."""
        call = PagedAttentionCall(batch=batch, layers=self.attention_layers)
        output = self.hf_model(
            input_ids=batch.input_ids[None],  # [1, num_tokens]: every sequence in one row
            position_ids=batch.positions[None],  # [1, num_tokens]
            use_cache=False,
            logits_to_keep=batch.logits_rows,
            **{PAGED_KWARG: call},
        )
        return output.logits[0].float()  # [num_logit_rows, vocab_size]


transformers.AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


def load_transformers_model(
    path: str, fmt: str, config: Any, dtype: torch.dtype, device: torch.device
) -> TransformersForCausalLM:
    """Load a model folder (``fmt == "hf"``) or GGUF file with transformers' ``AutoModelForCausalLM``
    and our paged attention; ValueError when the architecture cannot run this way.

    Never downloads and never trusts remote code. The model is checked (see the module docstring)
    before it is returned.
    """
    arch = (list(getattr(config, "architectures", None) or []) or [config.model_type])[0]
    _check_config(config, arch)
    auto_class = transformers.AutoModelForCausalLM
    common: dict[str, Any] = {
        "dtype": dtype,
        "attn_implementation": ATTENTION_NAME,
        "local_files_only": True,
        "trust_remote_code": False,
    }
    if fmt == "gguf":
        hf_model = auto_class.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), **common
        )
    else:
        mapping = transformers.MODEL_FOR_CAUSAL_LM_MAPPING
        if type(config) not in mapping:
            raise ValueError(f"{arch} has no AutoModelForCausalLM class in transformers")
        _check_backend(mapping[type(config)], arch)  # type: ignore[arg-type]  # before loading any weight
        hf_model = auto_class.from_pretrained(path, config=copy.deepcopy(config), **common)
    _check_backend(type(hf_model), arch)
    hf_model.to(device)  # type: ignore[arg-type]
    hf_model.eval()
    return TransformersForCausalLM(hf_model, device, dtype)
