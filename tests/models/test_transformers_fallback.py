"""The transformers fallback: architectures without a native implementation run transformers' own
model code over our paged KV cache, and match transformers run the ordinary way.

GPT-2 (learned absolute positions, Conv1D projections, tied head) and GPT-NeoX (partial rotary,
parallel residual, untied head) have no native implementation, so ``auto`` picks the fallback. The
batch mixes prompts of different lengths and output budgets under a small token budget (chunked
prefill, requests joining as others finish) with the prefix cache on; a later request reuses a
cached prefix. A Llama forced through the fallback matches the native Llama. Architectures the
fallback cannot run correctly are refused with a ValueError that says why.
"""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from tests.conftest import TinyModel, TinySpec, save_tiny_model
from tests.models.test_llama_family import as_inputs, assert_position_logprobs, tiny_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.config import build_engine_config
from tokenmill.engine_args import add_engine_args, engine_kwargs

FALLBACK_SPECS = {
    "gpt2": TinySpec("gpt2", "GPT2Config", {"n_positions": 256}),
    "gpt_neox": TinySpec(
        "gpt_neox",
        "GPTNeoXConfig",
        {"rotary_pct": 0.5, "use_parallel_residual": True, "tie_word_embeddings": False},
    ),
}
NUM_TOP = 3


def spread_weights(model: torch.nn.Module, seed: int) -> None:
    """Weights that make greedy outputs varied with wide argmax margins (see conftest.spread_weights),
    for the GPT-2/NeoX parameter names: embeddings of unit scale, LayerNorm gains near 1, small biases."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if any(part in name for part in ("wte", "wpe", "embed_in")):
                param.copy_(noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            elif "ln_" in name or "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(3.0 * noise / min(param.shape) ** 0.5)


@pytest.fixture(scope="module", params=sorted(FALLBACK_SPECS))
def fallback(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    spec = FALLBACK_SPECS[request.param]
    folder = str(tmp_path_factory.mktemp(f"tiny-{spec.arch}"))
    hf = save_tiny_model(spec, seed=41, folder=folder)
    spread_weights(hf, seed=5)
    hf.save_pretrained(folder)
    llm = LLM(folder, dtype="float32", block_size=4, num_blocks=96, max_num_batched_tokens=16, max_num_seqs=3)
    return TinyModel(arch=spec.arch, path=folder, hf=hf), llm


def test_auto_picks_the_fallback_and_the_mixed_batch_matches_transformers(fallback) -> None:  # type: ignore[no-untyped-def]
    model, llm = fallback
    runner = llm.engine.executor.runner
    assert runner.model_impl == "transformers"
    assert runner.model.num_layers == 2 and runner.model.sliding_window is None
    prompts = tiny_prompts()
    budgets = [9, 4, 12, 6, 10]  # requests finish at different steps; waiting ones join the batch
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=NUM_TOP) for n in budgets]
    outputs = llm.generate(as_inputs(prompts), params, use_tqdm=False)
    for prompt, budget, output in zip(prompts, budgets, outputs):
        completion = output.outputs[0]
        assert completion.token_ids == model.greedy(prompt, budget), f"prompt of {len(prompt)} tokens"
        reference = model.log_softmax(prompt + completion.token_ids)
        assert completion.logprobs is not None
        for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert_position_logprobs(entry, reference[len(prompt) - 1 + j], token, NUM_TOP)

    # A new request sharing the longest prompt's first 36 tokens reuses their cached blocks.
    shared = prompts[-1][:36] + [7, 8, 9, 10, 11]
    again = llm.generate(as_inputs([shared]), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert again.num_cached_tokens == 36
    assert again.outputs[0].token_ids == model.greedy(shared, 8)


def test_llama_forced_through_transformers_matches_native(
    tiny_model, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    model = tiny_model("llama")
    with caplog.at_level(logging.INFO, logger="tokenmill.worker.model_runner"):
        forced = LLM(model.path, dtype="float32", block_size=4, num_blocks=96, model_impl="transformers")
    assert "transformers implementation: transformers LlamaForCausalLM" in caplog.text
    native = LLM(model.path, dtype="float32", block_size=4, num_blocks=96, model_impl="native")
    assert native.engine.executor.runner.model_impl == "native"
    prompts = tiny_prompts()
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=NUM_TOP)
    ours = forced.generate(as_inputs(prompts), params, use_tqdm=False)
    theirs = native.generate(as_inputs(prompts), params, use_tqdm=False)
    for prompt, a, b in zip(prompts, ours, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == model.greedy(prompt, 10)
        assert a.outputs[0].logprobs is not None and b.outputs[0].logprobs is not None
        for entry_a, entry_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert set(entry_a) == set(entry_b)
            for token in entry_a:
                assert entry_a[token].logprob == pytest.approx(entry_b[token].logprob, abs=1e-4)


def test_a_sliding_window_reaches_the_paged_masks(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Mistral's window, read from its attention calls, masks prompts longer than the window."""
    folder = str(tmp_path_factory.mktemp("tiny-mistral-window-fallback"))
    spec = TinySpec("mistral", "MistralConfig", {"num_key_value_heads": 2, "sliding_window": 6})
    model = TinyModel(arch="mistral", path=folder, hf=save_tiny_model(spec, seed=11, folder=folder))
    llm = LLM(
        folder,
        dtype="float32",
        block_size=4,
        num_blocks=64,
        max_num_batched_tokens=16,
        model_impl="transformers",
    )
    assert llm.engine.executor.runner.model.sliding_window == 6
    prompts = [[10 + (7 * i + j) % 140 for j in range(length)] for i, length in enumerate((3, 9, 25))]
    outputs = llm.generate(as_inputs(prompts), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == model.greedy(prompt, 10)


def test_native_on_an_architecture_we_lack_names_it(fallback) -> None:  # type: ignore[no-untyped-def]
    model, _ = fallback
    architecture = type(model.hf).__name__
    with pytest.raises(ValueError, match=f"no native implementation for architecture.*{architecture}"):
        LLM(model.path, dtype="float32", num_blocks=16, model_impl="native")


def test_model_impl_is_validated_and_reaches_the_cli() -> None:
    with pytest.raises(ValueError, match="model_impl must be one of"):
        build_engine_config("smollm2-135m", model_impl="jax").validate()
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["model_impl"] == "auto"
    assert engine_kwargs(parser.parse_args(["--model-impl", "transformers"]))["model_impl"] == "transformers"


@pytest.mark.parametrize(
    "spec,reason",
    [
        # StableLM's attention does not take a custom attention function (nor forward its kwargs).
        (
            TinySpec("stablelm", "StableLmConfig", {}),
            "does not let StableLmForCausalLM use a custom attention",
        ),
        # Gemma 2 soft-caps attention logits and alternates sliding and full layers.
        (
            TinySpec("gemma2", "Gemma2Config", {"head_dim": 16, "num_key_value_heads": 2}),
            "Gemma2Attention soft-caps attention logits",
        ),
    ],
    ids=["stablelm", "gemma2"],
)
def test_architectures_the_fallback_cannot_run_are_refused(
    spec: TinySpec, reason: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = str(tmp_path_factory.mktemp(f"tiny-{spec.arch}"))
    save_tiny_model(spec, seed=1, folder=folder)
    with pytest.raises(ValueError, match=f"cannot run on the transformers fallback: .*{reason}"):
        LLM(folder, dtype="float32", num_blocks=16, model_impl="transformers")
