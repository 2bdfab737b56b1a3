"""Nemotron-H (Mamba-2 + attention + MLP blocks) against transformers, on the same state pool.

A tiny random float32 config whose blocks are Mamba-2, attention, Mamba-2, MLP (groups of heads
sharing B/C, a convolution with bias, a scan chunk of 8 tokens so prompts cross several chunks) must
give transformers' greedy tokens (its torch fallbacks are the reference) through the engine: several
prompts at once, chunked prefill carrying the SSM state across steps, preemption, and a prefix-cache
hit that restores a snapshot.
"""

from __future__ import annotations

import pytest

from tests.conftest import TinyModel, TinySpec, save_tiny_model
from tests.models.test_qwen3_next import kernel_calls, manager, prompts, run
from tokenmill import LLM

SPEC = TinySpec(
    "nemotron_h",
    "NemotronHConfig",
    {
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "mlp"],
        "num_key_value_heads": 2,
        "head_dim": 16,
        "mamba_num_heads": 8,
        "mamba_head_dim": 8,
        "ssm_state_size": 16,
        "n_groups": 2,
        "conv_kernel": 4,
        "chunk_size": 8,
        "intermediate_size": 96,
        "tie_word_embeddings": False,
    },
)
NUM_NEW = 10


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    folder = str(tmp_path_factory.mktemp("tiny-nemotron-h"))
    hf = save_tiny_model(SPEC, seed=47, folder=folder)
    hf.generation_config.eos_token_id = None
    return TinyModel(arch="nemotron_h", path=folder, hf=hf)


def make_llm(model: TinyModel, **kwargs: object) -> LLM:
    options: dict[str, object] = {
        "dtype": "float32",
        "block_size": 4,
        "num_blocks": 256,
        "max_num_batched_tokens": 16,
    }
    options.update(kwargs)
    return LLM(model.path, **options)


def test_greedy_matches_transformers_with_chunked_prefill(model: TinyModel) -> None:
    batch = prompts([5, 37, 61, 13])
    llm = make_llm(model, enable_prefix_caching=False)
    assert run(llm, batch) == [model.greedy(p, NUM_NEW) for p in batch]
    assert llm.engine.executor.runner.model.num_layers == 1


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_the_cpu_kernels_and_the_torch_reference_both_match(
    model: TinyModel, kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = kernel_calls(monkeypatch, kernels)
    batch = prompts([29, 11], salt=2)
    llm = make_llm(model, enable_prefix_caching=False)
    assert run(llm, batch) == [model.greedy(p, NUM_NEW) for p in batch]
    assert bool(calls) == (kernels == "1")  # the kernels ran exactly when switched on


def test_preemption_recomputes(model: TinyModel) -> None:
    batch = prompts([30, 26, 33, 28], salt=3)
    llm = make_llm(model, num_blocks=24, enable_prefix_caching=False, max_num_batched_tokens=32)
    assert run(llm, batch) == [model.greedy(p, NUM_NEW) for p in batch]
    assert llm.engine.scheduler.num_preemptions_total > 0


def test_prefix_hit_restores_a_snapshot(model: TinyModel) -> None:
    first = prompts([23], salt=11)[0]
    llm = make_llm(model)
    kv = manager(llm)
    reply = run(llm, [first])[0]
    assert reply == model.greedy(first, NUM_NEW)
    second = first + reply + [17, 18, 19, 20, 21]
    before = kv.prefix_hit_tokens
    assert run(llm, [second]) == [model.greedy(second, NUM_NEW)]
    assert kv.prefix_hit_tokens - before == 32  # the output-boundary snapshot after 32 tokens


def test_outputs_vary_and_the_worker_process_executor_carries_the_state(model: TinyModel) -> None:
    tokens = model.greedy(prompts([20])[0], NUM_NEW)
    assert len(set(tokens)) > 3  # a degenerate model could not tell a broken state from a right one
    # The plan deltas carry the state slot, the snapshot to resume from and the checkpoints.
    llm = make_llm(model, executor_backend="mp")
    try:
        first = prompts([23], salt=11)[0]
        reply = run(llm, [first])[0]
        second = first + reply + [17, 18, 19, 20, 21]
        assert [reply, *run(llm, [second])] == [model.greedy(first, NUM_NEW), model.greedy(second, NUM_NEW)]
        assert manager(llm).prefix_hit_tokens == 32
    finally:
        llm.engine.executor.shutdown()
