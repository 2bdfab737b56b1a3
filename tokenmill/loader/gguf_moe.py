"""GGUF files of the frontier MoE families: gpt-oss (``gpt-oss``) and DeepSeek-V3 / Kimi K2 (``deepseek2``).

``gguf_loader.py`` hands these architectures here. Both configs are built from the file's metadata
by our own mapping (transformers has no GGUF config reader for ``deepseek2``, and its ``gpt-oss`` one
fails on the ``rope.scaling.*`` keys with transformers 5.x), and the tensors come back under the Hugging
Face names and layouts the native models load (``models/gpt_oss.py``, ``models/deepseek_v3.py``).

What llama.cpp's converter did to the tensors, undone here:

- gpt-oss: the experts' interleaved ``gate_up_proj [E, hidden, 2I]`` was split into
  ``ffn_gate_exps`` and ``ffn_up_exps`` (``[E, I, hidden]`` each, biases ``[E, I]``) and
  ``down_proj [E, I, hidden]`` transposed into ``ffn_down_exps [E, hidden, I]``: they are interleaved
  and transposed back. ``self_attn.sinks`` is ``attn_sinks.weight``, the router ``ffn_gate_inp``, the
  norm before the MoE ``post_attention_norm``. Sliding layers are the even ones (llama.cpp's pattern);
  YaRN is read from ``rope.scaling.*`` with gpt-oss's ``truncate: false`` (every gpt-oss checkpoint).
- deepseek2: per-expert weights were stacked (``ffn_{gate,up,down}_exps``, shared experts
  ``*_shexp``), the router's correction bias is ``exp_probs_b.bias``; newer files split
  ``kv_b_proj`` into ``attn_k_b [H, kv_lora, nope]`` (transposed) and ``attn_v_b [H, v, kv_lora]``,
  which are joined back (a file holding ``attn_kv_b`` itself uses it). Rotary dimensions stay in the
  checkpoint's interleaved order (``rope_interleave``). ``rope.scaling.yarn_log_multiplier`` is
  ``0.1 * mscale_all_dim`` (and ``mscale`` is taken equal to it, as in the DeepSeek-V3 and Kimi K2
  configs). Only sigmoid routing (``expert_gating_func`` 2, V3 / K2) is served natively: a
  DeepSeek-V2 file (softmax routing) is refused with a clear message.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
import transformers

from tokenmill.loader.gguf_index import GGUFIndex, IndexedTensor

ARCHITECTURES = ("gpt-oss", "deepseek2")

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

_GPT_OSS_BLOCK = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate_inp": "mlp.router",
}

_DEEPSEEK_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}


def _get(fields: dict[str, Any], key: str, default: Any = None) -> Any:
    value = fields.get(key)
    return default if value is None else value


def _need(fields: dict[str, Any], key: str) -> Any:
    if key not in fields:
        raise ValueError(f"GGUF metadata {key!r} is missing; cannot build the model's config")
    return fields[key]


def _vocab_size(index: GGUFIndex, arch: str) -> int:
    stated = index.fields.get(f"{arch}.vocab_size")
    if isinstance(stated, int):
        return stated
    embedding = next((t for t in index.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise ValueError("GGUF file has no token_embd.weight")
    return int(embedding.shape[1])  # GGUF lists dimensions innermost first: [hidden, vocab]


def _tied(index: GGUFIndex) -> bool:
    return not any(t.name == "output.weight" for t in index.tensors)


def build_config(index: GGUFIndex, arch: str) -> transformers.PretrainedConfig:
    """The Hugging Face config of a ``gpt-oss`` or ``deepseek2`` file, from its metadata (module
    docstring). Raises ``ValueError`` naming a missing key or an unsupported variant."""
    if arch == "gpt-oss":
        return _gpt_oss_config(index)
    if arch == "deepseek2":
        return _deepseek_config(index)
    raise ValueError(f"no GGUF config mapping for architecture {arch!r}")


def _yarn(fields: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = fields.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "yarn":
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported for {arch} (only yarn)")
    return {
        "factor": float(_need(fields, f"{arch}.rope.scaling.factor")),
        "original_max_position_embeddings": int(
            _need(fields, f"{arch}.rope.scaling.original_context_length")
        ),
        "beta_fast": float(_get(fields, f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(_get(fields, f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
    }


def _gpt_oss_config(index: GGUFIndex) -> transformers.PretrainedConfig:
    f, a = index.fields, "gpt-oss"
    num_layers = int(_need(f, f"{a}.block_count"))
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(_get(f, f"{a}.rope.freq_base", 150000.0)),
    }
    yarn = _yarn(f, a)
    if yarn is not None:
        rope.update(yarn, rope_type="yarn", truncate=False)
    return transformers.GptOssConfig(
        architectures=["GptOssForCausalLM"],
        vocab_size=_vocab_size(index, a),
        hidden_size=int(_need(f, f"{a}.embedding_length")),
        intermediate_size=int(
            _get(f, f"{a}.expert_feed_forward_length") or _need(f, f"{a}.feed_forward_length")
        ),
        num_hidden_layers=num_layers,
        num_attention_heads=int(_need(f, f"{a}.attention.head_count")),
        num_key_value_heads=int(_need(f, f"{a}.attention.head_count_kv")),
        head_dim=int(_need(f, f"{a}.attention.key_length")),
        num_local_experts=int(_need(f, f"{a}.expert_count")),
        num_experts_per_tok=int(_need(f, f"{a}.expert_used_count")),
        sliding_window=int(_need(f, f"{a}.attention.sliding_window")),
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
        rms_norm_eps=float(_get(f, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_get(f, f"{a}.context_length", 131072)),
        rope_parameters=rope,
        tie_word_embeddings=_tied(index),
    )


def _deepseek_config(index: GGUFIndex) -> transformers.PretrainedConfig:
    f, a = index.fields, "deepseek2"
    gating = int(_get(f, f"{a}.expert_gating_func", 1))
    if gating != 2:
        raise ValueError(
            "this deepseek2 GGUF routes experts by softmax (DeepSeek-V2); only sigmoid routing "
            "(DeepSeek-V3, Kimi K2) is served natively: use the Hugging Face folder with "
            "--model-impl transformers"
        )
    heads = int(_need(f, f"{a}.attention.head_count"))
    rope_dim = int(_need(f, f"{a}.rope.dimension_count"))
    key_length = int(_get(f, f"{a}.attention.key_length_mla") or _need(f, f"{a}.attention.key_length"))
    value_length = int(_get(f, f"{a}.attention.value_length_mla") or _need(f, f"{a}.attention.value_length"))
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(_get(f, f"{a}.rope.freq_base", 10000.0)),
    }
    yarn = _yarn(f, a)
    if yarn is not None:
        mscale = float(_get(f, f"{a}.rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        rope.update(yarn, rope_type="yarn", mscale=mscale, mscale_all_dim=mscale)
    q_lora_rank = int(_get(f, f"{a}.attention.q_lora_rank", 0)) or None
    return transformers.DeepseekV3Config(
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=_vocab_size(index, a),
        hidden_size=int(_need(f, f"{a}.embedding_length")),
        intermediate_size=int(_need(f, f"{a}.feed_forward_length")),
        moe_intermediate_size=int(_need(f, f"{a}.expert_feed_forward_length")),
        num_hidden_layers=int(_need(f, f"{a}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        n_shared_experts=int(_get(f, f"{a}.expert_shared_count", 0)),
        n_routed_experts=int(_need(f, f"{a}.expert_count")),
        num_experts_per_tok=int(_need(f, f"{a}.expert_used_count")),
        routed_scaling_factor=float(_get(f, f"{a}.expert_weights_scale", 1.0)),
        n_group=int(_get(f, f"{a}.expert_group_count", 1)),
        topk_group=int(_get(f, f"{a}.expert_group_used_count", 1)),
        norm_topk_prob=bool(_get(f, f"{a}.expert_weights_norm", False)),
        first_k_dense_replace=int(_get(f, f"{a}.leading_dense_block_count", 0)),
        q_lora_rank=q_lora_rank,
        kv_lora_rank=int(_need(f, f"{a}.attention.kv_lora_rank")),
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=key_length - rope_dim,
        v_head_dim=value_length,
        rope_interleave=True,
        rms_norm_eps=float(_get(f, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(_get(f, f"{a}.context_length", 4096)),
        rope_parameters=rope,
        tie_word_embeddings=_tied(index),
    )


# ---------------------------------------------------------------- tensors


def _global_name(gguf_name: str) -> str | None:
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL and suffix in ("weight", "bias"):
        return f"{_GLOBAL[stem]}.{suffix}"
    return None


def _unknown(name: str) -> ValueError:
    return ValueError(f"GGUF tensor {name!r} has no known Hugging Face name")


def iter_weights(index: GGUFIndex, arch: str, to_torch: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for the file's weights, in Hugging Face names and layout
    (``to_torch`` dequantizes one ``IndexedTensor``). Unknown tensor names raise ``ValueError``."""
    tensors = {t.name: t for t in index.tensors}
    if arch == "gpt-oss":
        return _model_weights(tensors, to_torch, _gpt_oss_block)
    if arch == "deepseek2":
        return _model_weights(tensors, to_torch, _deepseek_block)
    raise ValueError(f"no GGUF tensor mapping for architecture {arch!r}")


def num_weight_tensors(index: GGUFIndex, arch: str) -> int:
    """How many tensors ``iter_weights`` yields."""
    names = [t.name for t in index.tensors]
    if arch == "gpt-oss":  # gate and up join into one tensor (weight and bias)
        return len(names) - sum(1 for n in names if ".ffn_up_exps." in n)
    count = 0
    for name in names:
        m = _BLOCK.fullmatch(name)
        kind = m.group(2) if m is not None else ""
        if kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            count += int(_shape(index, name)[-1])  # one tensor per expert
        elif kind == "attn_k_b":
            count += 0 if name.replace("attn_k_b", "attn_kv_b") in names else 1
        elif kind == "attn_v_b":
            continue
        else:
            count += 1
    return count


def _shape(index: GGUFIndex, name: str) -> tuple[int, ...]:
    """A tensor's GGUF shape (innermost dimension first)."""
    return next(tuple(int(d) for d in t.shape) for t in index.tensors if t.name == name)


def _model_weights(
    tensors: dict[str, IndexedTensor], to_torch: Any, block: Callable[..., Iterator[tuple[str, torch.Tensor]]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's transformers-named weights from a GGUF file's ``tensors``: the global ones
    (embeddings, final norm, head) by name, each block tensor by ``block(tensors, to_torch, name,
    "model.layers.<i>", kind, suffix)``; a tensor neither names raises ``ValueError``."""
    for name in tensors:
        hf = _global_name(name)
        if hf is not None:
            yield hf, to_torch(tensors[name])
            continue
        m = _BLOCK.fullmatch(name)
        if m is None:
            raise _unknown(name)
        layer, kind, suffix = m.groups()
        yield from block(tensors, to_torch, name, f"model.layers.{layer}", kind, suffix)


def _gpt_oss_block(
    tensors: dict[str, IndexedTensor], to_torch: Any, name: str, prefix: str, kind: str, suffix: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss's transformers weights from block tensor ``name`` (none for an up projection, joined
    with its gate)."""
    if kind == "attn_sinks" and suffix == "weight":
        yield f"{prefix}.self_attn.sinks", to_torch(tensors[name])
    elif kind in _GPT_OSS_BLOCK:
        yield f"{prefix}.{_GPT_OSS_BLOCK[kind]}.{suffix}", to_torch(tensors[name])
    elif kind == "ffn_gate_exps":
        up_name = name.replace("ffn_gate_exps", "ffn_up_exps")
        if up_name not in tensors:
            raise ValueError(f"GGUF tensor {name!r} has no {up_name!r} to pair with")
        gate, up = to_torch(tensors[name]), to_torch(tensors[up_name])  # [E, I, hidden] / [E, I]
        if suffix == "weight":
            gate, up = gate.transpose(1, 2), up.transpose(1, 2)  # [E, hidden, I]
        joined = torch.stack([gate, up], dim=-1).flatten(-2)  # [..., 2I]: gate, up interleaved
        yield f"{prefix}.mlp.experts.gate_up_proj{'' if suffix == 'weight' else '_bias'}", joined
    elif kind == "ffn_up_exps":
        return  # joined with its gate above
    elif kind == "ffn_down_exps":
        down = to_torch(tensors[name])  # [E, hidden, I] or bias [E, hidden]
        if suffix == "weight":
            down = down.transpose(1, 2).contiguous()  # [E, I, hidden]
        yield f"{prefix}.mlp.experts.down_proj{'' if suffix == 'weight' else '_bias'}", down
    else:
        raise _unknown(name)


def _deepseek_block(
    tensors: dict[str, IndexedTensor], to_torch: Any, name: str, prefix: str, kind: str, suffix: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """DeepSeek's transformers weights from block tensor ``name`` (experts split one by one; the
    attention's k_b and v_b joined into kv_b)."""
    if kind in _DEEPSEEK_BLOCK:
        yield f"{prefix}.{_DEEPSEEK_BLOCK[kind]}.{suffix}", to_torch(tensors[name])
    elif kind == "exp_probs_b":
        yield f"{prefix}.mlp.gate.e_score_correction_bias", to_torch(tensors[name])
    elif kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps") and suffix == "weight":
        proj = kind.removeprefix("ffn_").removesuffix("_exps")
        stacked = to_torch(tensors[name])  # [E, out, in]
        for expert in range(stacked.shape[0]):
            yield f"{prefix}.mlp.experts.{expert}.{proj}_proj.weight", stacked[expert]
    elif kind == "attn_k_b" and suffix == "weight":
        if name.replace("attn_k_b", "attn_kv_b") in tensors:
            return  # the file holds the joined tensor too
        v_name = name.replace("attn_k_b", "attn_v_b")
        if v_name not in tensors:
            raise ValueError(f"GGUF tensor {name!r} has no {v_name!r} to pair with")
        k_b = to_torch(tensors[name]).transpose(1, 2)  # [H, nope, kv_lora]
        v_b = to_torch(tensors[v_name])  # [H, v, kv_lora]
        kv_b = torch.cat([k_b, v_b], dim=1).flatten(0, 1)  # [H * (nope + v), kv_lora]
        yield f"{prefix}.self_attn.kv_b_proj.weight", kv_b
    elif kind == "attn_v_b":
        return  # joined with attn_k_b above
    else:
        raise _unknown(name)
