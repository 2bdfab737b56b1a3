"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against Hugging Face ``transformers``.

Tiny random configs with several experts and top-k >= 2; a batch of prompts of different lengths
(so the experts see different token groups every step) must give transformers' greedy tokens and
logprobs. Between them the configs cover both routing rules, ``norm_topk_prob`` on and off, a shared
expert, ``mlp_only_layers`` and ``decoder_sparse_step``.
"""

from __future__ import annotations

import pytest

from tests.conftest import TinyModel, TinySpec, save_tiny_model
from tests.models.test_llama_family import as_inputs, assert_position_logprobs, greedy, tiny_prompts
from tokenmill import LLM
from tokenmill.layers.fused_moe import SparseMoeBlock
from tokenmill.models.llama import LlamaMLP

MOE_SPECS = {
    # Softmax over the top-k logits; GQA.
    "mixtral": TinySpec(
        "mixtral",
        "MixtralConfig",
        {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    ),
    # Softmax over all experts, top-k renormalised; layer 1 dense (mlp_only_layers); q/k norm.
    "qwen3_moe": TinySpec(
        "qwen3_moe",
        "Qwen3MoeConfig",
        {
            "num_key_value_heads": 2,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
            "tie_word_embeddings": False,
        },
    ),
    # Top-3 probabilities left unnormalised, a gated shared expert, only layer 1 sparse (step 2).
    "qwen2_moe": TinySpec(
        "qwen2_moe",
        "Qwen2MoeConfig",
        {
            "num_key_value_heads": 2,
            "num_experts": 5,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 24,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": False,
            "decoder_sparse_step": 2,
        },
    ),
}
NUM_NEW = 12
# These random routers give large logits, where float32 rounding alone moves a logprob by more than
# the dense models' 1e-4: on an AVX2-only Zen 3, transformers' own float32 logprobs differ from its
# float64 ones by up to 2.6e-4 (mixtral) and 1.6e-4 (qwen2_moe), and ours from float64 by the same
# (2.6e-4, 1.6e-4). A wrong routing weight or a dropped expert moves them by far more.
MOE_LOGPROB_TOL = 5e-4


@pytest.fixture(scope="module", params=sorted(MOE_SPECS))
def moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    spec = MOE_SPECS[request.param]
    folder = str(tmp_path_factory.mktemp(f"tiny-{spec.arch}"))
    hf = save_tiny_model(spec, seed=31 + sorted(MOE_SPECS).index(request.param), folder=folder)
    llm = LLM(folder, dtype="float32", block_size=4, num_blocks=128, max_num_batched_tokens=32)
    return TinyModel(arch=spec.arch, path=folder, hf=hf), llm


def test_layers_are_sparse_where_the_config_says(moe) -> None:  # type: ignore[no-untyped-def]
    model, llm = moe
    ours = llm.engine.executor.runner.model
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.layers]
    expected = {"mixtral": [True, True], "qwen3_moe": [True, False], "qwen2_moe": [False, True]}[model.arch]
    assert sparse == expected
    assert all(isinstance(layer.mlp, (SparseMoeBlock, LlamaMLP)) for layer in ours.layers)
    shared = [
        layer.mlp.shared_expert is not None for layer in ours.layers if isinstance(layer.mlp, SparseMoeBlock)
    ]
    assert all(shared) == (model.arch == "qwen2_moe")


def test_moe_greedy_and_logprobs_match_transformers(moe) -> None:  # type: ignore[no-untyped-def]
    model, llm = moe
    prompts = tiny_prompts()
    num_top = 4
    outputs = llm.generate(as_inputs(prompts), greedy(NUM_NEW, logprobs=num_top), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        assert completion.token_ids == model.greedy(prompt, NUM_NEW), f"prompt of {len(prompt)} tokens"
        reference = model.log_softmax(prompt + completion.token_ids)
        assert completion.logprobs is not None
        for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert_position_logprobs(entry, reference[len(prompt) - 1 + j], token, num_top, MOE_LOGPROB_TOL)
