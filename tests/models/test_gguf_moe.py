"""GGUF files of gpt-oss and DeepSeek-V3 (``deepseek2``), loader/gguf_moe.py.

A tiny random model of each is written to GGUF with gguf-py's writer the way llama.cpp's converter
lays it out (gpt-oss: the interleaved gate/up split into ``ffn_gate_exps``/``ffn_up_exps``, experts
transposed, sinks as ``attn_sinks.weight``; DeepSeek: experts stacked, ``kv_b_proj`` split into
``attn_k_b``/``attn_v_b``, the correction bias as ``exp_probs_b.bias``, MLA metadata) and loaded: the
config is built from the metadata, every weight comes back equal to the safetensors one, and greedy
decoding equals both the safetensors load and transformers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers

from tests.conftest import TinyModel, save_tiny_model
from tests.models.test_deepseek_v3 import DEEPSEEK_SPECS
from tests.models.test_gpt_oss import GPT_OSS, WINDOW
from tests.models.test_llama_family import as_inputs, greedy
from tokenmill import LLM
from tokenmill.loader import gguf_loader
from tokenmill.loader.hf_loader import iter_weights as hf_iter_weights
from tokenmill.loader.source import resolve_model

PROMPTS = [[5, 17, 33, 9, 70, 41, 12, 8, 99, 23, 54, 31, 7], [60, 61, 2, 3]]  # the first past the window
NUM_NEW = 10


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Read the GGUF itself (no converted copy), cache converted metadata under tmp_path."""
    monkeypatch.setenv("TOKENMILL_CONVERT_GGUF", "0")
    monkeypatch.setattr(gguf_loader, "model_cache_dir", lambda: str(tmp_path / "cache"))


def _add(writer: gguf.GGUFWriter, name: str, tensor: torch.Tensor) -> None:
    writer.add_tensor(name, np.ascontiguousarray(tensor.detach().float().numpy(), dtype=np.float32))


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _common(writer: gguf.GGUFWriter, config: Any, hidden_key_length: int) -> None:
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_key_length(hidden_key_length)


def _write_gpt_oss(model: Any, path: Path) -> None:
    config = model.config
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    _common(writer, config, config.head_dim)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_value_length(config.head_dim)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_sliding_window(config.sliding_window)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "self_attn.sinks": "attn_sinks.weight",
        "mlp.router.weight": "ffn_gate_inp.weight",
        "mlp.router.bias": "ffn_gate_inp.bias",
    }
    for proj, gguf_name in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
        for suffix in ("weight", "bias"):
            names[f"self_attn.{proj}_proj.{suffix}"] = f"{gguf_name}.{suffix}"
    state = model.state_dict()
    _add(writer, "token_embd.weight", state["model.embed_tokens.weight"])
    _add(writer, "output_norm.weight", state["model.norm.weight"])
    _add(writer, "output.weight", state["lm_head.weight"])
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for hf_name, gguf_name in names.items():
            _add(writer, f"blk.{i}.{gguf_name}", state[prefix + hf_name])
        gate_up = state[prefix + "mlp.experts.gate_up_proj"]  # [E, hidden, 2I], gate/up interleaved
        gate_up_bias = state[prefix + "mlp.experts.gate_up_proj_bias"]  # [E, 2I]
        _add(writer, f"blk.{i}.ffn_gate_exps.weight", gate_up[..., ::2].transpose(1, 2))  # [E, I, hidden]
        _add(writer, f"blk.{i}.ffn_gate_exps.bias", gate_up_bias[..., ::2])
        _add(writer, f"blk.{i}.ffn_up_exps.weight", gate_up[..., 1::2].transpose(1, 2))
        _add(writer, f"blk.{i}.ffn_up_exps.bias", gate_up_bias[..., 1::2])
        down = state[prefix + "mlp.experts.down_proj"]  # [E, I, hidden]
        _add(writer, f"blk.{i}.ffn_down_exps.weight", down.transpose(1, 2))  # [E, hidden, I]
        _add(writer, f"blk.{i}.ffn_down_exps.bias", state[prefix + "mlp.experts.down_proj_bias"])
    _finish(writer)


def _write_deepseek(model: Any, path: Path, split_kv_b: bool = True, gating: Any = None) -> None:
    config = model.config
    nope, rope_dim, v_dim, lora = (
        config.qk_nope_head_dim,
        config.qk_rope_head_dim,
        config.v_head_dim,
        config.kv_lora_rank,
    )
    heads, inter = config.num_attention_heads, config.moe_intermediate_size
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    _common(writer, config, lora + rope_dim)  # the absorbed (MLA) form's sizes, as llama.cpp writes
    writer.add_key_length_mla(nope + rope_dim)
    writer.add_value_length(lora)
    writer.add_value_length_mla(v_dim)
    writer.add_head_count_kv(1)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_expert_feed_forward_length(inter)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    writer.add_expert_weights_norm(config.norm_topk_prob)
    writer.add_expert_gating_func(gating or gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_group_count(config.n_group)
    writer.add_expert_group_used_count(config.topk_group)
    if config.q_lora_rank:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(lora)
    writer.add_rope_dimension_count(rope_dim)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    names = {
        "input_layernorm.weight": "attn_norm",
        "post_attention_layernorm.weight": "ffn_norm",
        "self_attn.q_proj.weight": "attn_q",
        "self_attn.q_a_proj.weight": "attn_q_a",
        "self_attn.q_a_layernorm.weight": "attn_q_a_norm",
        "self_attn.q_b_proj.weight": "attn_q_b",
        "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa",
        "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm",
        "self_attn.o_proj.weight": "attn_output",
        "mlp.gate_proj.weight": "ffn_gate",
        "mlp.up_proj.weight": "ffn_up",
        "mlp.down_proj.weight": "ffn_down",
        "mlp.gate.weight": "ffn_gate_inp",
        "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp",
        "mlp.shared_experts.up_proj.weight": "ffn_up_shexp",
        "mlp.shared_experts.down_proj.weight": "ffn_down_shexp",
    }
    state = model.state_dict()
    _add(writer, "token_embd.weight", state["model.embed_tokens.weight"])
    _add(writer, "output_norm.weight", state["model.norm.weight"])
    _add(writer, "output.weight", state["lm_head.weight"])
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for hf_name, gguf_name in names.items():
            if prefix + hf_name in state:
                _add(writer, f"blk.{i}.{gguf_name}.weight", state[prefix + hf_name])
        kv_b = state[prefix + "self_attn.kv_b_proj.weight"]  # [H * (nope + v), lora]
        if split_kv_b:
            k_b, v_b = kv_b.view(heads, nope + v_dim, lora).split([nope, v_dim], dim=1)
            _add(writer, f"blk.{i}.attn_k_b.weight", k_b.transpose(1, 2))  # [H, lora, nope]
            _add(writer, f"blk.{i}.attn_v_b.weight", v_b)  # [H, v, lora]
        else:
            _add(writer, f"blk.{i}.attn_kv_b.weight", kv_b)
        if prefix + "mlp.experts.gate_up_proj" in state:
            gate_up = state[prefix + "mlp.experts.gate_up_proj"]  # [E, 2I, hidden]: gate rows, then up
            _add(writer, f"blk.{i}.ffn_gate_exps.weight", gate_up[:, :inter])
            _add(writer, f"blk.{i}.ffn_up_exps.weight", gate_up[:, inter:])
            _add(writer, f"blk.{i}.ffn_down_exps.weight", state[prefix + "mlp.experts.down_proj"])
            _add(writer, f"blk.{i}.exp_probs_b.bias", state[prefix + "mlp.gate.e_score_correction_bias"])
    _finish(writer)


def _tokenizer_from(monkeypatch: pytest.MonkeyPatch, folder: str) -> None:
    """The tiny models' tokenizer is not in the GGUF (nothing here is about tokenizers)."""
    monkeypatch.setattr(
        gguf_loader, "load_tokenizer", lambda path: transformers.AutoTokenizer.from_pretrained(folder)
    )


def _safetensors_weights(folder: str) -> dict[str, torch.Tensor]:
    return dict(hf_iter_weights(folder))


def _check_greedy(model: TinyModel, gguf_path: Path, **options: Any) -> None:
    settings: dict[str, Any] = {
        "dtype": "float32",
        "block_size": 4,
        "num_blocks": 64,
        "max_num_batched_tokens": 8,
    }
    settings.update(options)
    from_gguf = LLM(str(gguf_path), **settings)
    assert from_gguf.engine.executor.runner.model_impl == "native"
    from_folder = LLM(model.path, **settings)
    ours = from_gguf.generate(as_inputs(PROMPTS), greedy(NUM_NEW), use_tqdm=False)
    theirs = from_folder.generate(as_inputs(PROMPTS), greedy(NUM_NEW), use_tqdm=False)
    for prompt, a, b in zip(PROMPTS, ours, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == model.greedy(prompt, NUM_NEW)


def test_gpt_oss_gguf_loads_as_its_safetensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = str(tmp_path / "hf")
    hf = save_tiny_model(GPT_OSS, seed=23, folder=folder)
    hf.generation_config.eos_token_id = None
    path = tmp_path / "tiny-gpt-oss.gguf"
    _write_gpt_oss(hf, path)
    _tokenizer_from(monkeypatch, folder)

    source = resolve_model(str(path))
    assert source.format == "gguf"
    config = source.hf_config
    assert config.model_type == "gpt_oss" and config.sliding_window == WINDOW
    assert config.layer_types == hf.config.layer_types
    for key in ("rope_type", "factor", "original_max_position_embeddings", "rope_theta", "truncate"):
        assert config.rope_parameters[key] == hf.config.rope_parameters[key], key
    weights = dict(source.iter_weights())
    assert source.num_weight_tensors() == len(weights)
    expected = _safetensors_weights(folder)
    assert set(weights) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name

    _check_greedy(TinyModel(arch="gpt_oss", path=folder, hf=hf), path)


@pytest.mark.parametrize("split_kv_b", [True, False], ids=["k_b-v_b", "kv_b"])
def test_deepseek2_gguf_config_and_weights(tmp_path: Path, split_kv_b: bool) -> None:
    folder = str(tmp_path / "hf")
    hf = save_tiny_model(DEEPSEEK_SPECS["q-lora-yarn"], seed=31, folder=folder)
    path = tmp_path / "tiny-deepseek.gguf"
    _write_deepseek(hf, path, split_kv_b=split_kv_b)

    source = resolve_model(str(path))
    config, reference = source.hf_config, hf.config
    assert config.model_type == "deepseek_v3"
    for key in (
        "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
        "num_attention_heads", "n_shared_experts", "n_routed_experts", "num_experts_per_tok",
        "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob", "first_k_dense_replace",
        "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
        "rope_interleave", "vocab_size", "tie_word_embeddings",
    ):  # fmt: skip
        assert getattr(config, key) == getattr(reference, key), key
    for key in (
        "rope_type",
        "rope_theta",
        "factor",
        "original_max_position_embeddings",
        "mscale",
        "mscale_all_dim",
    ):
        assert config.rope_parameters[key] == pytest.approx(reference.rope_parameters[key]), key

    weights = dict(source.iter_weights())
    assert source.num_weight_tensors() == len(weights)
    # transformers stacks the experts; the GGUF gives them one by one, as the released checkpoints do.
    expected: dict[str, torch.Tensor] = {}
    inter = reference.moe_intermediate_size
    for name, tensor in _safetensors_weights(folder).items():
        if name.endswith("experts.gate_up_proj"):
            for e in range(tensor.shape[0]):
                expected[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = tensor[e, :inter]
                expected[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = tensor[e, inter:]
        elif name.endswith("experts.down_proj"):
            for e in range(tensor.shape[0]):
                expected[name.replace("down_proj", f"{e}.down_proj.weight")] = tensor[e]
        else:
            expected[name] = tensor
    assert set(weights) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


def test_deepseek2_gguf_greedy_equals_the_safetensors_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = str(tmp_path / "hf")
    hf = save_tiny_model(DEEPSEEK_SPECS["q-lora-yarn"], seed=37, folder=folder)
    hf.generation_config.eos_token_id = None
    path = tmp_path / "tiny-deepseek.gguf"
    _write_deepseek(hf, path)
    _tokenizer_from(monkeypatch, folder)
    # Through the converted-folder cache this time (the gpt-oss test reads the GGUF itself).
    monkeypatch.setenv("TOKENMILL_CONVERT_GGUF", "1")
    assert resolve_model(str(path)).format == "hf"  # converted on first resolve
    _check_greedy(TinyModel(arch="deepseek_v3", path=folder, hf=hf), path)


def test_deepseek_v2_softmax_routing_is_refused_clearly(tmp_path: Path) -> None:
    folder = str(tmp_path / "hf")
    hf = save_tiny_model(DEEPSEEK_SPECS["q-lora-yarn"], seed=41, folder=folder)
    path = tmp_path / "v2.gguf"
    _write_deepseek(hf, path, gating=gguf.ExpertGatingFuncType.SOFTMAX)
    with pytest.raises(ValueError, match="softmax .*DeepSeek-V2.*--model-impl transformers"):
        resolve_model(str(path))
    assert os.path.exists(path)
