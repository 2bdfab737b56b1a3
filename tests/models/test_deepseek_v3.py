"""DeepSeek-V3 (multi-head latent attention over a latent cache, DeepSeekMoE) against transformers.

Two tiny random configs in float32, three layers (the first dense), eight routed experts plus a
shared one: one with a low-rank query (``q_lora_rank``), interleaved rotary dims and YaRN scaling
(``mscale_all_dim`` changes the softmax scale), four expert groups of which two are kept; the other
with a direct ``q_proj``, plain RoPE in rotate-half layout, two groups of which one is kept and
unnormalised top-k weights. Both must give transformers' greedy tokens and logprobs through chunked
prefill, prefix-cache hits and preemption, and the cache must hold one latent row per token.
"""

from __future__ import annotations

import json
import shutil
from typing import Any

import pytest
import torch
import transformers

from tests.conftest import TinyModel, TinySpec, save_tiny_model
from tests.models.test_llama_family import as_inputs, assert_position_logprobs, greedy, tiny_prompts
from tokenmill import LLM
from tokenmill.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3MoE
from tokenmill.models.llama import LlamaMLP
from tokenmill.models.registry import resolve_model_class

KV_LORA_RANK, ROPE_DIM = 32, 16
COMMON: dict[str, Any] = {
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "kv_lora_rank": KV_LORA_RANK,
    "qk_rope_head_dim": ROPE_DIM,
    "qk_nope_head_dim": 32,
    "v_head_dim": 24,
    "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False,
}
DEEPSEEK_SPECS = {
    "q-lora-yarn": TinySpec(
        "deepseek_v3",
        "DeepseekV3Config",
        {
            **COMMON,
            "q_lora_rank": 48,
            "n_group": 4,
            "topk_group": 2,
            "norm_topk_prob": True,
            "rope_interleave": True,
            "rope_scaling": {
                "type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        },
    ),
    "q-proj-plain-rope": TinySpec(
        "deepseek_v3",
        "DeepseekV3Config",
        {
            **COMMON,
            "q_lora_rank": None,
            "n_group": 2,
            "topk_group": 1,
            "norm_topk_prob": False,
            "rope_interleave": False,
        },
    ),
}
NUM_NEW = 12
# As in test_moe.py, these random routers give large logits, where float32 rounding alone moves a
# logprob past 1e-4: against transformers in float64, its own float32 logprobs differ by up to
# 1.6e-4 (q-lora-yarn) and 1.0e-4, ours by 1.8e-4 and 0.8e-4. A wrong expert or scale moves far more.
LOGPROB_TOL = 5e-4


@pytest.fixture(scope="module", params=sorted(DEEPSEEK_SPECS))
def deepseek(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    spec = DEEPSEEK_SPECS[request.param]
    folder = str(tmp_path_factory.mktemp(f"tiny-deepseek-{request.param}"))
    hf = save_tiny_model(spec, seed=51 + sorted(DEEPSEEK_SPECS).index(request.param), folder=folder)
    hf.generation_config.eos_token_id = None
    return TinyModel(arch=request.param, path=folder, hf=hf)


def make_llm(model: TinyModel, **kwargs: Any) -> LLM:
    # Chunks of at most 16 tokens: the longer prompts are prefilled in several steps.
    options: dict[str, Any] = {"block_size": 4, "num_blocks": 128, "max_num_batched_tokens": 16}
    return LLM(model.path, dtype="float32", **{**options, **kwargs})


def test_layers_and_latent_cache_layout(deepseek: TinyModel) -> None:
    llm = make_llm(deepseek)
    runner = llm.engine.executor.runner
    model = runner.model
    assert isinstance(model, DeepseekV3ForCausalLM)
    assert [type(layer.mlp) for layer in model.layers] == [LlamaMLP, DeepseekV3MoE, DeepseekV3MoE]
    width = KV_LORA_RANK + ROPE_DIM
    assert all(tuple(cache.shape) == (1, 128, 4, 1, width) for cache in runner.kv_caches)
    # KV bytes per token: one latent row per layer, not 2 x heads x head_dim.
    assert runner.kv_cache_bytes == 128 * 4 * 3 * width * 4
    per_head_bytes = 128 * 4 * 3 * 2 * 4 * (32 + ROPE_DIM) * 4  # keys and values of 4 heads
    assert runner.kv_cache_bytes * 8 == per_head_bytes


def test_greedy_and_logprobs_match_transformers(deepseek: TinyModel) -> None:
    llm = make_llm(deepseek)
    prompts = tiny_prompts()
    num_top = 4
    outputs = llm.generate(as_inputs(prompts), greedy(NUM_NEW, logprobs=num_top), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        assert completion.token_ids == deepseek.greedy(prompt, NUM_NEW), f"prompt of {len(prompt)} tokens"
        reference = deepseek.log_softmax(prompt + completion.token_ids)
        assert completion.logprobs is not None
        for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert_position_logprobs(entry, reference[len(prompt) - 1 + j], token, num_top, LOGPROB_TOL)


def test_prefix_cache_hits_give_the_same_tokens(deepseek: TinyModel) -> None:
    llm = make_llm(deepseek)
    shared = tiny_prompts()[-1][:17]  # four full blocks and one more token
    prompts = [shared + [5 + k] * k for k in range(1, 4)]
    first = llm.generate(as_inputs([shared]), greedy(NUM_NEW), use_tqdm=False)
    rest = llm.generate(as_inputs(prompts), greedy(NUM_NEW), use_tqdm=False)
    assert first[0].outputs[0].token_ids == deepseek.greedy(shared, NUM_NEW)
    assert [o.num_cached_tokens for o in rest] == [16] * len(prompts)
    for prompt, output in zip(prompts, rest):
        assert output.outputs[0].token_ids == deepseek.greedy(prompt, NUM_NEW)


def test_preemption_under_a_tiny_pool_keeps_outputs_exact(deepseek: TinyModel) -> None:
    # 14 blocks of 4 tokens: the longest request (41 + 12 tokens) fits alone, the batch does not.
    llm = make_llm(deepseek, num_blocks=14)
    prompts = tiny_prompts()
    outputs = llm.generate(as_inputs(prompts), greedy(NUM_NEW), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in outputs] == [deepseek.greedy(p, NUM_NEW) for p in prompts]


def _answers(outputs: list[Any]) -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    """Tokens and every position's (token, logprob) pairs, for exact comparison."""
    return [
        (
            list(o.outputs[0].token_ids),
            [sorted((t, lp.logprob) for t, lp in row.items()) for row in o.outputs[0].logprobs],
        )
        for o in outputs
    ]


def test_deterministic_mode_is_batch_invariant_and_matches_transformers(deepseek: TinyModel) -> None:
    """The latent cache in the deterministic mode (layers/attention/deterministic_mla.py): each
    prompt alone and in a batch (16-token chunks) give bitwise the same tokens and logprobs, after a
    prefix-cache hit too, and transformers' greedy tokens."""
    llm = make_llm(deepseek, deterministic=True)
    assert all(type(layer.self_attn.attn).__name__ == "DeterministicMLABackend" for layer in llm_layers(llm))
    prompts = tiny_prompts()
    params = greedy(NUM_NEW, logprobs=3)
    batched = _answers(llm.generate(as_inputs(prompts), params, use_tqdm=False))
    alone = make_llm(deepseek, deterministic=True, enable_prefix_caching=False, max_num_batched_tokens=64)
    for prompt, answer in zip(prompts, batched, strict=True):
        assert _answers(alone.generate(as_inputs([prompt]), params, use_tqdm=False)) == [answer]
        assert answer[0] == deepseek.greedy(prompt, NUM_NEW), f"prompt of {len(prompt)} tokens"
    hit = llm.generate(as_inputs([prompts[-1]]), params, use_tqdm=False)  # its prompt is cached now
    assert hit[0].num_cached_tokens > 0 and _answers(hit) == [batched[-1]]


def llm_layers(llm: LLM) -> list[Any]:
    return list(llm.engine.executor.runner.model.layers)


def test_deepseek_v32_names_the_transformers_fallback() -> None:
    config = transformers.DeepseekV3Config(architectures=["DeepseekV32ForCausalLM"])
    with pytest.raises(ValueError, match="sparse attention.*--model-impl transformers"):
        resolve_model_class(config)


def test_router_keeps_float32_under_bfloat16() -> None:
    config = transformers.DeepseekV3Config(
        hidden_size=16,
        moe_intermediate_size=8,
        n_routed_experts=4,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
    )
    moe = DeepseekV3MoE(config, torch.bfloat16).to(torch.bfloat16)
    assert moe.gate.weight.dtype == torch.float32
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.experts.w13.dtype == torch.bfloat16


def test_kimi_k2_config_loads_as_deepseek_v3(deepseek: TinyModel, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Kimi K2's config.json: model_type kimi_k2 (remote code transformers does not ship) over the
    # DeepseekV3ForCausalLM architecture; it must load natively without trusting remote code.
    folder = tmp_path / "kimi-k2"
    shutil.copytree(deepseek.path, folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "kimi_k2"
    config["auto_map"] = {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    }
    (folder / "config.json").write_text(json.dumps(config))
    llm = make_llm(deepseek.__class__(arch="kimi_k2", path=str(folder), hf=deepseek.hf))
    assert isinstance(llm.engine.executor.runner.model, DeepseekV3ForCausalLM)
    prompt = tiny_prompts()[3]
    output = llm.generate(as_inputs([prompt]), greedy(NUM_NEW), use_tqdm=False)[0]
    assert output.outputs[0].token_ids == deepseek.greedy(prompt, NUM_NEW)


FP8_BLOCK = (32, 32)  # DeepSeek's releases use 128 x 128; the tiny layers need smaller blocks


def _quantize_fp8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] as float8_e4m3fn with one float32 scale per block (edge blocks partial)."""
    out_features, in_features = weight.shape
    rows, cols = -(-out_features // FP8_BLOCK[0]), -(-in_features // FP8_BLOCK[1])
    scales = torch.empty(rows, cols)
    quantized = torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn)
    for r in range(rows):
        for c in range(cols):
            rs = slice(r * FP8_BLOCK[0], (r + 1) * FP8_BLOCK[0])
            cs = slice(c * FP8_BLOCK[1], (c + 1) * FP8_BLOCK[1])
            scales[r, c] = weight[rs, cs].abs().max() / 448.0
            quantized[rs, cs] = (weight[rs, cs] / scales[r, c]).to(torch.float8_e4m3fn)
    return quantized, scales


def test_fp8_block_checkpoint_is_dequantized_on_load(deepseek: TinyModel, tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """A checkpoint in DeepSeek's fp8 format (fp8 projection weights, ``weight_scale_inv`` per block,
    ``quantization_config.weight_block_size``) loads with each weight dequantized: greedy tokens equal
    transformers' over the dequantized weights, and the memory it needs is logged."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "fp8"
    shutil.copytree(deepseek.path, folder)
    state = load_file(str(folder / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        is_projection = name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight")
        if is_projection and tensor.dim() == 2:
            weight, scales = _quantize_fp8_blocks(tensor)
            quantized[name], quantized[name + "_scale_inv"] = weight, scales
            rows = scales.repeat_interleave(FP8_BLOCK[0], 0)[: tensor.shape[0]]
            dequantized[name] = weight.float() * rows.repeat_interleave(FP8_BLOCK[1], 1)[:, : tensor.shape[1]]
        else:
            quantized[name] = dequantized[name] = tensor
    # Two shards: the first holds the scales of layers 1 and 2, so those arrive before their weights
    # (a shard lists its tensors sorted, so layer 0's weights come before their scales).
    early = {n for n in quantized if n.endswith("_scale_inv") and ".layers.0." not in n}
    shards = {
        "model-00001-of-00002.safetensors": early,
        "model-00002-of-00002.safetensors": set(quantized) - early,
    }
    (folder / "model.safetensors").unlink()
    for shard, names in shards.items():
        save_file({n: quantized[n].contiguous() for n in names}, str(folder / shard))
    weight_map = {n: shard for shard, names in shards.items() for n in names}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(FP8_BLOCK),
    }
    (folder / "config.json").write_text(json.dumps(config))
    num_fp8 = sum(1 for n in quantized if n.endswith("_scale_inv"))
    assert num_fp8 > 20

    plain = tmp_path / "dequantized"  # the same weights in float32, for transformers
    shutil.copytree(deepseek.path, plain)
    save_file(dequantized, str(plain / "model.safetensors"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    fp8_model = TinyModel(arch="fp8", path=str(folder), hf=reference)
    with caplog.at_level("WARNING", logger="tokenmill.loader.fp8_blocks"):
        llm = make_llm(fp8_model)
    assert f"dequantizing {num_fp8} fp8 weights" in caplog.text
    assert "GB in bfloat16" in caplog.text
    prompts = tiny_prompts()[2:4]
    outputs = llm.generate(as_inputs(prompts), greedy(NUM_NEW), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == fp8_model.greedy(prompt, NUM_NEW)
    # The fp8 rounding changed the weights: the reference is not the original model.
    assert not torch.equal(
        dequantized["model.layers.0.self_attn.o_proj.weight"], state["model.layers.0.self_attn.o_proj.weight"]
    )


def test_fp8_stream_rejects_a_weight_without_its_scale() -> None:
    from tokenmill.loader.fp8_blocks import dequantize_stream

    weight = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="without their weight or scale.*a.weight"):
        list(dequantize_stream([("a.weight", weight)], (2, 2)))
    with pytest.raises(ValueError, match="needs scales of shape \\(2, 2\\), got \\(1, 1\\)"):
        list(dequantize_stream([("a.weight", weight), ("a.weight_scale_inv", torch.ones(1, 1))], (2, 2)))


def test_transformers_fallback_runs_deepseek_with_narrower_values(deepseek: TinyModel) -> None:
    # The benchmarks' baseline: transformers' DeepSeek-V3 over the paged cache, its values (24 wide)
    # zero-padded to the keys' width (48) in a per-head cache.
    llm = make_llm(deepseek, model_impl="transformers")
    runner = llm.engine.executor.runner
    assert runner.model_impl == "transformers"
    assert tuple(runner.kv_caches[0].shape) == (2, 128, 4, 4, 32 + ROPE_DIM)
    prompts = tiny_prompts()[1:4]
    outputs = llm.generate(as_inputs(prompts), greedy(NUM_NEW), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [deepseek.greedy(p, NUM_NEW) for p in prompts]
