"""The deterministic mode: a request's tokens and logprobs are bitwise the same alone, among 64 other
requests, under any chunk size, with or without a prefix-cache hit and after preemption; and the
combinations it cannot keep are refused."""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import VOCAB_SIZE, TinyModel
from tokenmill.config import EngineConfig, LoRAConfig, ModelConfig, build_engine_config
from tokenmill.engine_args import add_engine_args, engine_kwargs
from tokenmill.layers import fused_cpu
from tokenmill.layers.batch_invariant import row_kernel_available
from tokenmill.llm import LLM
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

rng = random.Random(0)
PROBE = [rng.randrange(2, VOCAB_SIZE) for _ in range(37)]
OTHERS = [[rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randrange(3, 40))] for _ in range(64)]
GREEDY = SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=10, logprobs=3, ignore_eos=True)

Answer = tuple[list[int], list[list[tuple[int, float]]]]


def answer(output: RequestOutput) -> Answer:
    """Tokens and every position's (token, logprob) pairs: compared exactly, not approximately."""
    completion = output.outputs[0]
    assert completion.logprobs is not None
    logprobs = [sorted((t, lp.logprob) for t, lp in position.items()) for position in completion.logprobs]
    return completion.token_ids, logprobs


# (tiny model, engine options): float32; bfloat16 with heads of 64 (the compiled kernels' shapes);
# int8 and int4 weights (bfloat16 rows on the row kernels where built, batch_invariant.py; int4 also
# through the row-independent fused stack).
SETTINGS = {
    "float32": ("llama", {"dtype": "float32"}),
    "bfloat16": ("wide-heads", {"dtype": "bfloat16"}),
    "int8": ("wide-heads", {"dtype": "bfloat16", "quantization": "int8"}),
    "int4": ("wide-heads", {"dtype": "bfloat16", "quantization": "int4"}),
}


def make_llm(model: tuple[TinyModel, dict[str, Any]], **kwargs: Any) -> LLM:
    tiny, settings = model
    options = {"block_size": 4, "num_blocks": 1024, "deterministic": True, **settings, **kwargs}
    return LLM(tiny.path, **options)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[Answer]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [answer(o) for o in outputs]


@pytest.fixture(scope="module", params=sorted(SETTINGS))
def model(
    request: pytest.FixtureRequest, tiny_model: Callable[[str], TinyModel]
) -> tuple[TinyModel, dict[str, Any]]:
    arch, settings = SETTINGS[request.param]
    return tiny_model(arch), settings


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_alone_and_among_64_others_are_bitwise_equal(
    model: tuple[TinyModel, dict[str, Any]], params: SamplingParams
) -> None:
    alone = run(make_llm(model, enable_prefix_caching=False), [PROBE], params)[0]
    crowd = run(make_llm(model, enable_prefix_caching=False), [*OTHERS[:32], PROBE, *OTHERS[32:]], params)
    assert crowd[32] == alone


@pytest.mark.parametrize("chunk", [4, 16, 24])
def test_chunk_sizes_give_the_same_bits(model: tuple[TinyModel, dict[str, Any]], chunk: int) -> None:
    whole = run(make_llm(model, enable_prefix_caching=False), [PROBE], GREEDY)[0]
    chunked_llm = make_llm(model, enable_prefix_caching=False, max_num_batched_tokens=chunk)
    assert run(chunked_llm, [PROBE, OTHERS[0]], GREEDY)[0] == whole


def test_a_prefix_cache_hit_gives_the_same_bits(model: tuple[TinyModel, dict[str, Any]]) -> None:
    miss = run(make_llm(model, enable_prefix_caching=False), [PROBE], GREEDY)[0]
    llm = make_llm(model)
    # Caches the first 28 tokens (7 blocks).
    llm.generate([{"prompt_token_ids": PROBE[:29] + [5]}], SamplingParams(max_tokens=1), use_tqdm=False)
    hit = llm.generate([{"prompt_token_ids": PROBE}], GREEDY, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 28
    assert answer(hit) == miss


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_preemption_and_recompute_give_the_same_bits(
    model: tuple[TinyModel, dict[str, Any]], params: SamplingParams
) -> None:
    prompts = [PROBE, *OTHERS[:7]]
    roomy = run(make_llm(model, enable_prefix_caching=False), prompts, params)
    tight = make_llm(model, enable_prefix_caching=False, num_blocks=24)  # 96 tokens for 8 requests
    assert run(tight, prompts, params) == roomy
    assert tight.engine.scheduler.num_preemptions_total > 0


@pytest.mark.parametrize(
    ("model_config", "message"),
    [
        (ModelConfig(dtype="float32", model_impl="transformers"), "native model implementation"),
        (ModelConfig(dtype="bfloat16"), "cannot be combined with LoRA yet"),
    ],
)
def test_combinations_it_cannot_keep_are_refused(model_config: ModelConfig, message: str) -> None:
    lora = LoRAConfig(enable_lora="LoRA" in message)
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=model_config, lora=lora, deterministic=True).validate()


def test_unseeded_random_requests_are_reproducible_and_siblings_differ(
    model: tuple[TinyModel, dict[str, Any]],
) -> None:
    """An unseeded request samples from the engine's seed and the position: the same alone and in a
    crowd; its n=2 siblings draw differently from each other."""
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, logprobs=2, ignore_eos=True)
    alone = run(make_llm(model, enable_prefix_caching=False), [PROBE], unseeded)[0]
    crowd = run(make_llm(model, enable_prefix_caching=False), [*OTHERS[:16], PROBE], unseeded)
    assert crowd[16] == alone
    pair = SamplingParams(temperature=1.0, max_tokens=12, n=2, ignore_eos=True)
    outputs = make_llm(model).generate([{"prompt_token_ids": PROBE}], pair, use_tqdm=False)[0].outputs
    assert outputs[0].token_ids != outputs[1].token_ids


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_speculative_decoding_gives_the_bits_of_decoding_without_it(
    model: tuple[TinyModel, dict[str, Any]], params: SamplingParams
) -> None:
    """With drafts from a draft model (the same tiny model: long runs accepted under greedy, some
    rejected when sampling), a request's tokens and logprobs are those of the mode without
    speculation, alone or among others: verified rows attend as decodes and each samples with its
    own position's generator."""
    tiny, _ = model
    plain = run(make_llm(model, enable_prefix_caching=False), [PROBE], params)[0]
    spec = {"method": "draft_model", "model": tiny.path, "num_speculative_tokens": 3}
    llm = make_llm(model, enable_prefix_caching=False, speculative_config=spec)
    assert run(llm, [PROBE], params)[0] == plain
    assert run(llm, [*OTHERS[:8], PROBE], params)[8] == plain
    stats = llm.engine.kv_stats()
    assert 0 < stats["spec_num_accepted_tokens"] <= stats["spec_num_draft_tokens"]


def test_the_command_line_turns_it_on() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--deterministic", "--dtype", "float32"])
    assert build_engine_config("m", **engine_kwargs(args)).deterministic
    assert not build_engine_config("m", **engine_kwargs(parser.parse_args([]))).deterministic


@pytest.mark.parametrize("arch", ["wide-heads", "qwen3"])
def test_the_fused_stack_stays_row_independent_and_matches_the_layer_modules(
    tiny_model: Callable[[str], TinyModel], monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    """bfloat16 int4 layers keep the fused decode stack in the mode, declared row-independent: it takes
    steps of up to its max_rows (prompt rows too, as decodes), gives a request the same bits alone and
    in a crowd, and the same bits as the mode's layer modules (qwen3: per-head q/k norms)."""
    llm = make_llm((tiny_model(arch), SETTINGS["int4"][1]), enable_prefix_caching=False)
    model = llm.engine.executor.runner.model
    stack = model.decode_stack
    if not row_kernel_available():  # the AVX2 / portable builds: no row kernels, the stack is dropped
        assert stack is None
        return
    assert stack is not None and stack.row_independent and stack.wide is None
    calls: list[int] = []
    original = fused_cpu.llama_decode_stack

    def counting(hidden: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(hidden.shape[0])
        assert kwargs["row_independent"] and kwargs["chunks"] is None
        return original(hidden, *args, **kwargs)

    monkeypatch.setattr(fused_cpu, "llama_decode_stack", counting)
    # Alone, the decode steps (one row) take the stack; in the crowd, steps of more than max_rows
    # rows take the layer modules (the bfloat16 row kernel): the same bits.
    alone = run(llm, [PROBE], GREEDY)
    assert calls and max(calls) <= stack.max_rows
    crowd = run(llm, [*OTHERS[:32], PROBE, *OTHERS[32:]], GREEDY)
    assert crowd[32] == alone[0]
    llm.update_weights_from_disk(tiny_model(arch).path)  # the same weights: rebuilt, still row-independent
    assert model.decode_stack is not None and model.decode_stack.row_independent
    assert run(llm, [PROBE], GREEDY)[0] == alone[0]
    calls.clear()
    model.decode_stack = None  # the mode's layer modules only
    assert run(llm, [PROBE], GREEDY)[0] == alone[0] and not calls
