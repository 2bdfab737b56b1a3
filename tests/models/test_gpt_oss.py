"""gpt-oss against transformers: attention sinks, alternating sliding/full layers, YaRN, the biased
router and the clamped-SwiGLU experts, through chunked prefill, prefix-cache hits and preemption;
and its MXFP4 checkpoints (experts as ``*_blocks`` / ``*_scales``), dequantized on load."""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import TinyModel, TinySpec, save_tiny_model
from tests.models.test_llama_family import as_inputs, assert_position_logprobs, greedy
from tokenmill import LLM
from tokenmill.core.kv.window_group import WindowGroupKVManager
from tokenmill.layers.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from tokenmill.models.gpt_oss import GptOssArgs, GptOssForCausalLM

WINDOW = 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
GPT_OSS = TinySpec(
    "gpt_oss",
    "GptOssConfig",
    {
        "num_hidden_layers": len(LAYER_TYPES),
        "layer_types": LAYER_TYPES,
        "sliding_window": WINDOW,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
        # YaRN as the real checkpoints have it, with a short original context so it changes frequencies.
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    },
)
PROMPT_LENGTHS = (1, 5, 12, 23, 41)  # most longer than the window, two longer than a prefill chunk
NUM_NEW = 12
# As for the other MoE models (test_moe.py), these random routers give large logits, where float32
# rounding alone moves a logprob by more than the dense models' 1e-4: on this model transformers' own
# float32 logprobs are up to 5.3e-4 from its float64 ones, ours 3.4e-4 (a Zen 4). So logprobs are
# checked against transformers in float64, where a wrong sink, window or expert moves them far more.
LOGPROB_TOL = 5e-4


def _prompts() -> list[list[int]]:
    rng = random.Random(77)
    return [[rng.randrange(5, 160) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    folder = str(tmp_path_factory.mktemp("tiny-gpt-oss"))
    hf = save_tiny_model(GPT_OSS, seed=5, folder=folder)
    hf.generation_config.eos_token_id = None
    return TinyModel(arch="gpt_oss", path=folder, hf=hf)


@pytest.fixture(scope="module")
def llm(tiny_gpt_oss: TinyModel) -> LLM:
    # Chunks of at most 16 tokens: the 23- and 41-token prompts prefill over several steps.
    return LLM(tiny_gpt_oss.path, dtype="float32", block_size=4, num_blocks=128, max_num_batched_tokens=16)


def _float64_log_softmax(model: TinyModel, token_ids: list[int]) -> torch.Tensor:
    hf64 = copy.deepcopy(model.hf).double()
    hf64.set_experts_implementation("eager")  # the grouped-matmul experts take no float64
    with torch.no_grad():
        return torch.log_softmax(hf64(torch.tensor([token_ids])).logits[0], dim=-1).float()


def test_greedy_and_logprobs_match_transformers(tiny_gpt_oss: TinyModel, llm: LLM) -> None:
    runner = llm.engine.executor.runner
    assert runner.model_impl == "native" and isinstance(runner.model, GptOssForCausalLM)
    assert runner.layer_sliding_windows == [WINDOW, None, WINDOW, None]
    prompts = _prompts()
    num_top = 4
    params = greedy(NUM_NEW, logprobs=num_top, prompt_logprobs=num_top)
    outputs = llm.generate(as_inputs(prompts), params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        assert completion.token_ids == tiny_gpt_oss.greedy(prompt, NUM_NEW), f"prompt of {len(prompt)}"
        reference = _float64_log_softmax(tiny_gpt_oss, prompt + completion.token_ids)  # [len, vocab]
        assert completion.logprobs is not None
        for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert_position_logprobs(entry, reference[len(prompt) - 1 + j], token, num_top, LOGPROB_TOL)
        assert output.prompt_logprobs is not None
        for t in range(1, len(prompt)):
            assert_position_logprobs(
                output.prompt_logprobs[t], reference[t - 1], prompt[t], num_top, LOGPROB_TOL
            )


def test_prefix_cache_hit_and_preemption_keep_the_tokens(tiny_gpt_oss: TinyModel, llm: LLM) -> None:
    longest = _prompts()[-1]
    llm.generate(as_inputs([longest]), greedy(2), use_tqdm=False)
    shared = longest[:36] + [7, 8, 9, 10, 11]  # 36 tokens (9 blocks) cached, past the window
    again = llm.generate(as_inputs([shared]), greedy(NUM_NEW), use_tqdm=False)[0]
    assert again.num_cached_tokens == 36
    assert again.outputs[0].token_ids == tiny_gpt_oss.greedy(shared, NUM_NEW)

    # Four requests growing to 29-65 tokens (46 blocks of 4) over 30 blocks: some are preempted and
    # recomputed.
    small = LLM(tiny_gpt_oss.path, dtype="float32", block_size=4, num_blocks=30, max_num_batched_tokens=16)
    prompts = _prompts()[1:]
    outputs = small.generate(as_inputs(prompts), greedy(24), use_tqdm=False)
    assert small.engine.kv_stats()["num_preemptions"] > 0
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == tiny_gpt_oss.greedy(prompt, 24)


def test_full_layers_keep_every_block(llm: LLM) -> None:
    """Half the layers attend globally, so their group never releases a block; the sliding layers'
    own group does (tests/models/test_gpt_oss_window_group.py)."""
    kv = llm.engine.kv_manager
    assert isinstance(kv, WindowGroupKVManager)
    assert kv.sliding_window is None and kv.window.sliding_window == WINDOW
    assert llm.engine.executor.runner.kv_window is None


def _last_logits(hf, prompt: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, -1]


def test_sinks_and_windows_make_the_difference(tiny_gpt_oss: TinyModel) -> None:
    """The reference's output depends on the sinks and on the sliding layers' window at these sizes,
    so the tests above could not pass with either ignored."""
    hf = tiny_gpt_oss.hf
    prompt = [10 + j for j in range(20)]
    original = _last_logits(hf, prompt)
    sinks = [layer.self_attn.sinks.data.clone() for layer in hf.model.layers]
    try:
        for layer in hf.model.layers:
            layer.self_attn.sinks.data.fill_(-1e4)  # exp(-1e4) = 0: no sink
        assert not torch.allclose(_last_logits(hf, prompt), original, atol=1e-3)
    finally:
        for layer, saved in zip(hf.model.layers, sinks):
            layer.self_attn.sinks.data.copy_(saved)
    hf.config.layer_types = ["full_attention"] * len(LAYER_TYPES)
    try:
        assert not torch.allclose(_last_logits(hf, prompt), original, atol=1e-3)
    finally:
        hf.config.layer_types = LAYER_TYPES
    assert torch.equal(_last_logits(hf, prompt), original)


def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(tiny_gpt_oss: TinyModel) -> None:
    hf_bf16 = copy.deepcopy(tiny_gpt_oss.hf).to(torch.bfloat16)
    llm = LLM(tiny_gpt_oss.path, dtype="bfloat16", block_size=4, num_blocks=128, max_num_batched_tokens=16)
    prompts = _prompts()
    outputs = llm.generate(as_inputs(prompts), greedy(4, prompt_logprobs=0), use_tqdm=False)
    ours, theirs = [], []
    for prompt, output in zip(prompts, outputs):
        reference = tiny_gpt_oss.log_softmax(prompt)
        with torch.no_grad():
            hf_logprobs = torch.log_softmax(hf_bf16(torch.tensor([prompt])).logits[0].float(), dim=-1)
        assert output.prompt_logprobs is not None
        for t in range(1, len(prompt)):
            value = output.prompt_logprobs[t][prompt[t]].logprob
            assert math.isfinite(value) and value <= 0.0
            ours.append(abs(value - reference[t - 1, prompt[t]].item()))
            theirs.append(abs(hf_logprobs[t - 1, prompt[t]].item() - reference[t - 1, prompt[t]].item()))
    mean_ours, mean_theirs = sum(ours) / len(ours), sum(theirs) / len(theirs)
    assert mean_ours <= 1.5 * mean_theirs + 0.05, (mean_ours, mean_theirs)
    assert max(ours) <= 2.0 * max(theirs) + 0.1, (max(ours), max(theirs))


# ---------------------------------------------------------------- MXFP4 checkpoints


def test_dequantize_matches_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), generator=generator, dtype=torch.uint8)  # [E, rows, G, 16]
    scales = torch.randint(117, 137, (3, 8, 4), generator=generator, dtype=torch.uint8)  # [E, rows, G]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, G * 32, rows]
    ours = dequantize_mxfp4(blocks, scales, torch.float32)  # [E, rows, G * 32]
    assert torch.equal(ours.transpose(1, 2), theirs)
    # Quantizing what was dequantized gives the same values back.
    again = dequantize_mxfp4(*quantize_mxfp4(ours), torch.float32)
    assert torch.equal(again, ours)
    with pytest.raises(ValueError, match="do not pair up"):
        dequantize_mxfp4(blocks, scales[..., :3], torch.float32)


def _write_mxfp4_checkpoint(model: TinyModel, folder: str) -> torch.nn.Module:
    """``model``'s folder rewritten with MXFP4 experts; returns its transformers twin holding exactly the
    dequantized expert weights (the reference for the MXFP4 folder)."""
    hf = copy.deepcopy(model.hf)
    tensors = load_file(os.path.join(model.path, "model.safetensors"))
    for index, layer in enumerate(hf.model.layers):
        experts = layer.mlp.experts
        prefix = f"model.layers.{index}.mlp.experts"
        for proj in ("gate_up_proj", "down_proj"):
            param = getattr(experts, proj)  # [E, in, out]; the checkpoint's rows are [E, out, in]
            blocks, scales = quantize_mxfp4(param.data.transpose(1, 2))
            param.data.copy_(dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2))
            del tensors[f"{prefix}.{proj}"]
            tensors[f"{prefix}.{proj}_blocks"] = blocks.contiguous()
            tensors[f"{prefix}.{proj}_scales"] = scales.contiguous()
    for name in os.listdir(model.path):
        if name != "model.safetensors":
            with (
                open(os.path.join(model.path, name), "rb") as src,
                open(os.path.join(folder, name), "wb") as dst,
            ):
                dst.write(src.read())
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    with open(config_path, "w") as f:
        json.dump(config, f)
    return hf


def test_mxfp4_checkpoint_loads_and_matches_transformers(
    tiny_gpt_oss: TinyModel, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    hf = _write_mxfp4_checkpoint(tiny_gpt_oss, str(tmp_path))
    reference = TinyModel(arch="gpt_oss", path=str(tmp_path), hf=hf)
    with caplog.at_level(logging.WARNING, logger="tokenmill.models.gpt_oss"):
        llm = LLM(str(tmp_path), dtype="float32", block_size=4, num_blocks=96, max_num_batched_tokens=16)
    assert "experts are MXFP4" in caplog.text and "GB of expert weights" in caplog.text
    prompts = _prompts()
    outputs = llm.generate(as_inputs(prompts), greedy(NUM_NEW), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == reference.greedy(prompt, NUM_NEW)
    # The reference holds the FP4-rounded experts, not the original ones: the folder's MXFP4 was read.
    rounded, original = hf.model.layers[0].mlp.experts, tiny_gpt_oss.hf.model.layers[0].mlp.experts
    assert not torch.equal(rounded.gate_up_proj, original.gate_up_proj)
    assert not torch.equal(rounded.down_proj, original.down_proj)


def test_mxfp4_half_without_its_pair_and_other_quantizations_are_refused(tiny_gpt_oss: TinyModel) -> None:
    config = copy.deepcopy(tiny_gpt_oss.hf.config)
    model = GptOssForCausalLM(config, torch.float32)
    blocks = torch.zeros(4, 128, 2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="without their pair"):
        model.load_weights([("model.layers.0.mlp.experts.gate_up_proj_blocks", blocks)])
    config.quantization_config = {"quant_method": "fp8"}
    with pytest.raises(ValueError, match="quantization 'fp8' is not supported natively"):
        GptOssArgs.from_hf(config)


def test_deterministic_mode_is_batch_invariant(tiny_gpt_oss: TinyModel) -> None:
    """In the deterministic mode a request's logprobs are bit-identical alone and in a batch: the sinks
    go through the deterministic backend and every (token, expert) pair is computed alone (a matmul
    over the tokens a batch routed to one expert rounds differently with their number)."""
    llm = LLM(
        tiny_gpt_oss.path,
        dtype="float32",
        block_size=4,
        num_blocks=128,
        max_num_batched_tokens=16,
        deterministic=True,
    )
    prompts = _prompts()
    params = greedy(8, logprobs=0)
    alone = llm.generate(as_inputs([prompts[3]]), params, use_tqdm=False)[0].outputs[0]
    batched = llm.generate(as_inputs(prompts), params, use_tqdm=False)[3].outputs[0]
    assert alone.token_ids == batched.token_ids == tiny_gpt_oss.greedy(prompts[3], 8)
    assert alone.logprobs is not None and batched.logprobs is not None
    for token, a, b in zip(alone.token_ids, alone.logprobs, batched.logprobs):
        assert a[token].logprob == b[token].logprob
