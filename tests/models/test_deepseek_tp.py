"""DeepSeek-V3 over two tensor-parallel ranks (gloo on this CPU), with and without expert parallelism.

The tiny ``q-lora-yarn`` config of ``test_deepseek_v3.py`` (four heads, a dense layer 0, eight
routed experts plus a shared one) in float32: every rank attends with two of the four heads over a
full copy of the latent cache; the routed experts are split by their intermediate features, or with
``enable_expert_parallel`` four whole experts per rank. Greedy tokens equal transformers' (and the
single-process engine's) through chunked prefill and a prefix-cache hit; each rank holds only its
share of the weights.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TinyModel, save_tiny_model
from tests.models.test_deepseek_v3 import DEEPSEEK_SPECS, KV_LORA_RANK, LOGPROB_TOL, ROPE_DIM
from tests.models.test_llama_family import as_inputs, greedy
from tests.models.test_tensor_parallel import assert_greedy_matches, shut, tp_llm
from tokenmill import LLM
from tokenmill.layers.fused_moe import FusedExperts
from tokenmill.layers.tensor_parallel import TensorParallel
from tokenmill.loader import resolve_model
from tokenmill.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3MoE

SPEC = "q-lora-yarn"
NUM_EXPERTS, MOE_INTERMEDIATE = 8, 32


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    folder = str(tmp_path_factory.mktemp("tiny-deepseek-tp"))
    hf = save_tiny_model(DEEPSEEK_SPECS[SPEC], seed=51 + sorted(DEEPSEEK_SPECS).index(SPEC), folder=folder)
    hf.generation_config.eos_token_id = None
    return TinyModel(arch=SPEC, path=folder, hf=hf)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["experts-sliced", "whole-experts"])
def test_deepseek_over_two_ranks_matches_transformers(deepseek: TinyModel, expert_parallel: bool) -> None:
    llm = tp_llm(
        deepseek.path,
        num_blocks=128,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        enable_expert_parallel=expert_parallel,
    )
    try:
        prompts = [[10 + (7 * i + 3 * j) % 200 for j in range(n)] for i, n in enumerate((1, 5, 13, 22))]
        assert_greedy_matches(llm, deepseek, prompts, LOGPROB_TOL)
        # A prompt sharing 16 tokens (four full blocks) with the one above: a prefix-cache hit.
        shared = prompts[3][:16] + [3, 4, 5]
        hits = llm.engine.kv_manager.prefix_hit_tokens
        output = llm.generate(as_inputs([shared]), greedy(8), use_tqdm=False)[0]
        assert llm.engine.kv_manager.prefix_hit_tokens > hits
        assert output.outputs[0].token_ids == deepseek.greedy(shared, 8)
        # The latent cache is whole on every rank: one row of kv_lora_rank + rope per token and layer.
        assert llm.engine.executor.kv_cache_bytes == 128 * 4 * 3 * (KV_LORA_RANK + ROPE_DIM) * 4
        assert llm.engine.kv_manager.all_free_or_cached()
    finally:
        shut(llm)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["experts-sliced", "whole-experts"])
def test_each_rank_holds_only_its_share(deepseek: TinyModel, expert_parallel: bool) -> None:
    """Built and loaded as ranks 0 and 1 would be (no collective runs before a forward)."""
    source = resolve_model(deepseek.path)
    reference = deepseek.hf.state_dict()
    whole = sum(t.numel() for name, t in reference.items() if ".mlp.experts." in name)
    held = 0
    for rank in range(2):
        tp = TensorParallel(rank, 2, expert_parallel=expert_parallel)
        with torch.device("cpu"):
            model = DeepseekV3ForCausalLM(source.hf_config, torch.float32, tp=tp)
        model.load_weights(source.iter_weights())
        attention = model.layers[0].self_attn
        assert attention.num_heads == 2 and attention.attn.num_heads == 2
        assert attention.kv_b_proj.weight.shape == (2 * (32 + 24), KV_LORA_RANK)
        assert attention.kv_a_proj_with_mqa.weight.shape == (KV_LORA_RANK + ROPE_DIM, 64)  # whole
        moe = model.layers[1].mlp
        assert isinstance(moe, DeepseekV3MoE) and isinstance(moe.experts, FusedExperts)
        experts = moe.experts
        if expert_parallel:  # four whole experts: 0-3 on rank 0, 4-7 on rank 1
            assert experts.w13.shape == (4, 2 * MOE_INTERMEDIATE, 64)
            assert experts.w2.shape == (4, 64, MOE_INTERMEDIATE)
            hf_experts = deepseek.hf.model.layers[1].mlp.experts
            first = 4 * rank
            torch.testing.assert_close(experts.w2.data, hf_experts.down_proj.data[first : first + 4])
        else:  # every expert, half of its intermediate features
            assert experts.w13.shape == (NUM_EXPERTS, MOE_INTERMEDIATE, 64)
            assert experts.w2.shape == (NUM_EXPERTS, 64, MOE_INTERMEDIATE // 2)
        held += sum(
            layer.mlp.experts.w13.numel() + layer.mlp.experts.w2.numel()
            for layer in model.layers
            if isinstance(layer.mlp, DeepseekV3MoE)
        )
    assert held == whole  # the two ranks together hold every expert weight once


def test_heads_or_experts_that_do_not_split_are_refused(deepseek: TinyModel) -> None:
    config = resolve_model(deepseek.path).hf_config
    with pytest.raises(ValueError, match=r"the attention heads \(4\) do not split evenly across 3"):
        DeepseekV3ForCausalLM(config, torch.float32, tp=TensorParallel(0, 3))
    config.num_attention_heads = 8  # the heads split over 8 ranks; the 8 experts over 8, not 16
    DeepseekV3ForCausalLM(config, torch.float32, tp=TensorParallel(0, 8, expert_parallel=True))
    with pytest.raises(ValueError, match=r"the experts \(8\) do not split evenly across 16"):
        config.num_attention_heads = 16
        DeepseekV3ForCausalLM(config, torch.float32, tp=TensorParallel(0, 16, expert_parallel=True))


def test_expert_parallel_with_one_rank_changes_nothing(deepseek: TinyModel) -> None:
    """As vLLM's flag does with one rank: accepted, and the one rank holds every expert."""
    llm = LLM(deepseek.path, dtype="float32", block_size=4, num_blocks=64, enable_expert_parallel=True)
    model = llm.engine.executor.runner.model
    moe = model.layers[1].mlp
    assert isinstance(moe, DeepseekV3MoE) and moe.experts.w13.shape == (NUM_EXPERTS, 2 * MOE_INTERMEDIATE, 64)
    prompt = [10 + 3 * j for j in range(9)]
    output = llm.generate(as_inputs([prompt]), greedy(6), use_tqdm=False)[0]
    assert output.outputs[0].token_ids == deepseek.greedy(prompt, 6)
