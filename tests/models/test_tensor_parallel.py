"""Tensor parallelism (``tensor_parallel_size=2``): two worker processes joined by torch.distributed
(gloo on this CPU), each holding its shard of the weights and a KV cache of its heads.

In float32 every model gives the tokens transformers gives (and so the single-process engine's):
a tiny Llama with its two KV heads split over the ranks, a tiny Mistral whose one KV head is
replicated on both, a tiny Qwen2-MoE (experts split by their intermediate features, a shared
expert), a tiny Gemma 3 (sliding and global layers, soft-capped logits), and SmolLM2-135M, whose
three KV heads split unevenly (one and two). Chunked prefill, the prefix cache, n = 2 with seeded
sampling and a step paused between layers work as with one process; blocks all come back; a rank
that dies is a clear error, never a hang; combinations that do not compose yet are refused by name.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import pytest
import torch

from tests.conftest import TinyModel, save_tiny_model
from tests.models.test_gemma3 import GEMMA3
from tests.models.test_llama_family import (
    LOGPROB_TOL,
    SMOL_PLAIN,
    as_inputs,
    assert_position_logprobs,
    greedy,
    hf_greedy,
    smol_hf,
    smollm2_gguf,
    tiny_prompts,
)
from tests.models.test_moe import MOE_LOGPROB_TOL, MOE_SPECS
from tests.unit.test_first_token_pass import request, stepper, tiny_llm
from tokenmill import LLM, SamplingParams
from tokenmill.config import build_engine_config
from tokenmill.core.engine_core import EngineCore
from tokenmill.engine_args import add_engine_args, engine_kwargs
from tokenmill.executor.multiproc import MultiProcessExecutor, WorkerProcessError
from tokenmill.layers.tensor_parallel import TensorParallel
from tokenmill.loader import resolve_model
from tokenmill.step_control import InterruptFlag

__all__ = ["smol_hf"]  # a fixture, used by name

NUM_NEW = 8


def tp_llm(path: str, **overrides: object) -> LLM:
    """``path`` over two tensor-parallel ranks (one thread each), float32, 4-token blocks."""
    settings: dict[str, object] = {
        "dtype": "float32",
        "block_size": 4,
        "num_blocks": 96,
        "seed": 0,
        "tensor_parallel_size": 2,
        "num_threads": 2,
        **overrides,
    }
    return LLM(path, **settings)  # type: ignore[arg-type]


def shut(llm: LLM) -> None:
    llm.engine.executor.shutdown()


def assert_greedy_matches(llm: LLM, model: TinyModel, prompts: list[list[int]], tolerance: float) -> None:
    """Greedy tokens equal transformers'; every logprob within ``tolerance`` of its distribution."""
    outputs = llm.generate(as_inputs(prompts), greedy(NUM_NEW, logprobs=2), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        assert completion.token_ids == model.greedy(prompt, NUM_NEW)
        reference = model.log_softmax(prompt + completion.token_ids)
        assert completion.logprobs is not None
        for position, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert_position_logprobs(entry, reference[len(prompt) - 1 + position], token, 2, tolerance)


def generate_mixed(llm: LLM) -> list[list[list[int]]]:
    """Greedy and seeded n = 2 requests sharing a prefix (a prefix-cache hit), under the engine's
    16-token budget (chunked prefill)."""
    shared = [11 + i for i in range(12)]
    prompts = [shared + [3, 4, 5], shared + [6, 7], [40 + i for i in range(21)]]
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=7, n=2, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(as_inputs(prompts) * 2, [plain] * 3 + [seeded] * 3, use_tqdm=False)
    return [[completion.token_ids for completion in output.outputs] for output in outputs]


# ---------------------------------------------------------------- how heads and features split


def test_heads_split_evenly_unevenly_or_replicated() -> None:
    """(query heads, KV heads) per rank: split, uneven (SmolLM2's 9 over 3 KV heads), replicated."""
    ranks = [TensorParallel(rank, 2) for rank in range(2)]
    assert [tp.head_ranges(4, 2) for tp in ranks] == [((0, 2), (0, 1)), ((2, 2), (1, 1))]
    assert [tp.head_ranges(9, 3) for tp in ranks] == [((0, 3), (0, 1)), ((3, 6), (1, 2))]
    assert [tp.head_ranges(4, 1) for tp in ranks] == [((0, 2), (0, 1)), ((2, 2), (0, 1))]
    with pytest.raises(ValueError, match="cannot be shared by 3 tensor-parallel ranks"):
        TensorParallel(0, 3).head_ranges(4, 2)
    with pytest.raises(ValueError, match=r"output features \(10\) do not split evenly across 4"):
        TensorParallel(1, 4).even_range(10, "output features")


# ---------------------------------------------------------------- dense, GQA split


@pytest.fixture(scope="module")
def llama(tiny_model) -> TinyModel:  # type: ignore[no-untyped-def]
    return tiny_model("llama")


def test_tiny_llama_over_two_ranks_equals_one_process(llama: TinyModel) -> None:
    settings: dict[str, object] = {"max_num_batched_tokens": 16, "enable_prefix_caching": True}
    single = tiny_llm(llama, num_threads=1, **settings)
    expected = generate_mixed(single)
    tp = tp_llm(llama.path, **settings)
    executor = tp.engine.executor
    try:
        assert isinstance(executor, MultiProcessExecutor) and len(executor.worker_pids) == 2
        assert generate_mixed(tp) == expected
        assert expected[0] == [llama.greedy([11 + i for i in range(12)] + [3, 4, 5], 6)]
        assert tp.engine.kv_manager.prefix_hit_tokens > 0
        # Each rank caches one of the two KV heads: half the bytes per block.
        assert executor.num_blocks == 96
        assert 2 * executor.kv_cache_bytes == single.engine.executor.kv_cache_bytes
        assert executor.collective_rpc("prefault_while_idle") in ([True] * 2, [False] * 2, [True, False])
        assert_greedy_matches(tp, llama, tiny_prompts(), LOGPROB_TOL)
        assert tp.engine.kv_manager.all_free_or_cached()
    finally:
        shut(tp)


def test_a_step_paused_between_layers_goes_on_in_every_rank(tiny_model, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The ranks agree on where the step stops (one collective decision), then go on from there."""
    model = tiny_model("x-four-layers")
    llm = tp_llm(model.path, short_prefill_interrupt=8, first_token_pass=True)
    core = llm.engine
    flag = InterruptFlag.create(str(tmp_path))
    core.set_interrupt(flag)
    prompts = {"a": [11 + i for i in range(13)], "b": [40 + i for i in range(5)]}
    tokens: dict[str, list[int]] = {name: [] for name in prompts}
    step = stepper(core, tokens)
    try:
        core.add_request(request("a", prompts["a"], 6))
        flag.raise_()
        assert step() == []
        assert core.num_paused_steps == 1
        flag.clear()
        core.add_request(request("b", prompts["b"], 6))
        assert step() == ["b"]
        assert step() == ["a"]
        while core.has_unfinished_requests():
            step()
        assert tokens == {name: model.greedy(prompt, 6) for name, prompt in prompts.items()}
        assert core.kv_manager.all_free_or_cached()
    finally:
        shut(llm)


# ---------------------------------------------------------------- one KV head, MoE, Gemma 3


def test_one_kv_head_replicated_on_both_ranks(tiny_model) -> None:  # type: ignore[no-untyped-def]
    model = tiny_model("mistral")
    llm = tp_llm(model.path)
    try:
        assert_greedy_matches(llm, model, tiny_prompts(), LOGPROB_TOL)
        single = LLM(model.path, dtype="float32", block_size=4, num_blocks=96)
        assert llm.engine.executor.kv_cache_bytes == single.engine.executor.kv_cache_bytes  # replicated
    finally:
        shut(llm)


def test_tiny_qwen2_moe_over_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = str(tmp_path_factory.mktemp("tiny-qwen2-moe-tp"))
    hf = save_tiny_model(
        MOE_SPECS["qwen2_moe"], seed=31 + sorted(MOE_SPECS).index("qwen2_moe"), folder=folder
    )
    hf.generation_config.eos_token_id = None
    llm = tp_llm(folder, num_blocks=128, max_num_batched_tokens=32)
    try:
        assert_greedy_matches(llm, TinyModel("qwen2_moe", folder, hf), tiny_prompts(), MOE_LOGPROB_TOL)
    finally:
        shut(llm)


def test_tiny_qwen3_moe_with_whole_experts_per_rank(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Expert parallelism: six experts, three whole ones on each rank (a dense layer 1 split as usual)."""
    folder = str(tmp_path_factory.mktemp("tiny-qwen3-moe-ep"))
    hf = save_tiny_model(
        MOE_SPECS["qwen3_moe"], seed=31 + sorted(MOE_SPECS).index("qwen3_moe"), folder=folder
    )
    hf.generation_config.eos_token_id = None
    llm = tp_llm(folder, num_blocks=128, max_num_batched_tokens=32, enable_expert_parallel=True)
    try:
        assert_greedy_matches(llm, TinyModel("qwen3_moe", folder, hf), tiny_prompts(), MOE_LOGPROB_TOL)
    finally:
        shut(llm)


def test_experts_split_whole_or_by_features() -> None:
    from tokenmill.layers.fused_moe import FusedExperts

    whole = FusedExperts(6, 8, 4, "silu", torch.float32, tp=TensorParallel(1, 2, expert_parallel=True))
    assert (whole.first_expert, whole.num_local_experts, tuple(whole.w13.shape)) == (3, 3, (3, 8, 8))
    sliced = FusedExperts(6, 8, 4, "silu", torch.float32, tp=TensorParallel(1, 2))
    assert (sliced.num_local_experts, tuple(sliced.w13.shape), tuple(sliced.w2.shape)) == (
        6,
        (6, 4, 8),
        (6, 8, 2),
    )
    with pytest.raises(ValueError, match=r"the experts \(5\) do not split evenly across 2"):
        FusedExperts(5, 8, 4, "silu", torch.float32, TensorParallel(0, 2, expert_parallel=True))


def test_tiny_gemma3_over_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = str(tmp_path_factory.mktemp("tiny-gemma3-tp"))
    hf = save_tiny_model(GEMMA3, seed=31, folder=folder)
    hf.generation_config.eos_token_id = None
    llm = tp_llm(folder, max_num_batched_tokens=24)
    try:
        prompts = [[10 + (11 * i + 3 * j) % 140 for j in range(n)] for i, n in enumerate((1, 6, 11, 27))]
        assert_greedy_matches(llm, TinyModel("gemma3_text", folder, hf), prompts, LOGPROB_TOL)
    finally:
        shut(llm)


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_bfloat16_logprobs_over_two_ranks_are_close_to_one_process(
    llama: TinyModel, quantization: str | None
) -> None:
    """Each rank quantizes its own shard. int4 groups of 32 input features never straddle a shard,
    so the weights are the same values; int8 scales each output row by its largest value, which a
    row-parallel shard takes over its half of the row only (a finer rounding, other values). The
    partial sums are rounded to bfloat16 before the all-reduce, so logprobs agree to bfloat16's
    resolution, not exactly (and int8's by its rounding too)."""
    prompts = tiny_prompts()[1:4]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    settings: dict[str, object] = {"dtype": "bfloat16", "quantization": quantization}
    single = LLM(llama.path, block_size=4, num_blocks=96, **settings)  # type: ignore[arg-type]
    expected = single.generate(as_inputs(prompts), params, use_tqdm=False)
    llm = tp_llm(llama.path, **settings)
    try:
        outputs = llm.generate(as_inputs(prompts), params, use_tqdm=False)
    finally:
        shut(llm)
    for ours, theirs in zip(outputs, expected):
        first, reference = ours.outputs[0], theirs.outputs[0]
        assert first.logprobs is not None and reference.logprobs is not None
        # The first position's distribution: one process's choice is among ours, as likely.
        token = reference.token_ids[0]
        assert token in first.logprobs[0]
        tolerance = 0.25 if quantization == "int8" else 0.1
        assert first.logprobs[0][token].logprob == pytest.approx(
            reference.logprobs[0][token].logprob, abs=tolerance
        )


# ---------------------------------------------------------------- SmolLM2: uneven KV heads (once)


def test_smollm2_over_two_ranks_matches_transformers(smol_hf) -> None:  # type: ignore[no-untyped-def]
    smollm2_gguf()
    llm = LLM("smollm2-135m", dtype="float32", num_blocks=64, tensor_parallel_size=2, num_threads=2)
    try:
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer.encode(text) for text in SMOL_PLAIN[:3]]
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outputs = llm.generate(as_inputs(prompts), params, use_tqdm=False)
        for prompt, output in zip(prompts, outputs):
            assert output.outputs[0].token_ids == hf_greedy(smol_hf, prompt, 12), tokenizer.decode(prompt)
    finally:
        shut(llm)


# ---------------------------------------------------------------- faults and refusals


def test_a_rank_killed_mid_run_is_an_engine_fault_not_a_hang(llama: TinyModel) -> None:
    config = build_engine_config(
        llama.path, dtype="float32", num_blocks=16, tensor_parallel_size=2, num_threads=2
    )
    core = EngineCore(config, resolve_model(llama.path))
    executor = core.executor
    assert isinstance(executor, MultiProcessExecutor)
    core.add_request(request("a", [5, 6, 7], 2))
    core.step()
    os.kill(executor.worker_pids[1], signal.SIGKILL)
    core.add_request(request("b", [8, 9, 10], 2))
    started = time.monotonic()
    with pytest.raises(
        WorkerProcessError, match=f"tensor-parallel rank 1 exited with code {-signal.SIGKILL}"
    ):
        while True:
            core.step()
    with pytest.raises(WorkerProcessError, match="rank 1 exited"):
        core.step()  # stays failed
    assert time.monotonic() - started < 30
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in executor.worker_pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in executor.worker_pids)  # rank 0 was stopped too


def _alive(pid: int) -> bool:
    try:
        finished, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return finished == 0


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative decoding"),
        ({"deterministic": True}, "deterministic mode"),
        ({"model_impl": "transformers"}, "the transformers model implementation"),
    ],
)
def test_combinations_that_do_not_compose_yet_are_refused_by_name(
    settings: dict[str, object], named: str
) -> None:
    config = build_engine_config("m", tensor_parallel_size=2, dtype="float32", **settings)
    with pytest.raises(ValueError, match=f"tensor parallelism .* cannot be combined with {named} yet"):
        config.validate()


def test_lora_adapters_over_two_ranks_equal_peft(llama: TinyModel, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """LoRA under TP: ``B`` of the column-parallel q/k/v and gate/up split by output rows, ``A`` of
    the row-parallel o/down by input columns (its delta summed by the all-reduce). Two adapters and
    the base in one batch give transformers + PEFT's greedy tokens, as the single process does."""
    from tests.models.lora_adapters import make_adapter
    from tokenmill.lora import LoRARequest

    adapters = [
        make_adapter(llama.hf, str(tmp_path / f"a{i}"), f"a{i}", seed=60 + i, rank=rank, scale=0.6)
        for i, rank in enumerate((8, 5))
    ]
    prompts = tiny_prompts()[1:4]
    batch = [prompt for prompt in prompts for _ in range(3)]
    choice = [None, 0, 1] * len(prompts)
    requests = [None if c is None else LoRARequest(adapters[c].name, c + 1, adapters[c].path) for c in choice]
    llm = tp_llm(llama.path, enable_lora=True, max_loras=2, max_lora_rank=8)
    try:
        outputs = llm.generate(as_inputs(batch), greedy(NUM_NEW), use_tqdm=False, lora_request=requests)
        for prompt, c, output in zip(batch, choice, outputs):
            want = llama.greedy(prompt, NUM_NEW) if c is None else adapters[c].greedy(prompt, NUM_NEW)
            assert output.outputs[0].token_ids == want, (c, prompt)
        assert (
            sum(
                output.outputs[0].token_ids != llama.greedy(prompt, NUM_NEW)
                for prompt, c, output in zip(batch, choice, outputs)
                if c is not None
            )
            >= 2
        ), "the adapters should change outputs"
        assert llm.engine.kv_manager.all_free_or_cached()
    finally:
        shut(llm)


def test_the_cli_flags() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--tensor-parallel-size", "2", "--threads-per-rank", "3"])
    config = build_engine_config("m", **engine_kwargs(args))
    assert (config.tensor_parallel_size, config.threads_per_rank) == (2, 3)
    assert config.distributed_executor_backend == "mp" and not config.enable_expert_parallel
    assert build_engine_config(
        "m", **engine_kwargs(parser.parse_args(["--enable-expert-parallel"]))
    ).enable_expert_parallel
    config = build_engine_config("m", **engine_kwargs(parser.parse_args(["-tp", "2"])))
    assert config.tensor_parallel_size == 2
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        build_engine_config("m", tensor_parallel_size=0).validate()
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        build_engine_config("m", distributed_executor_backend="slurm").validate()


def test_threads_split_over_the_ranks() -> None:
    from tokenmill.executor.multiproc import config_for_ranks

    config = build_engine_config("m", tensor_parallel_size=2, num_threads=6)
    assert config_for_ranks(config).num_threads == 3
    config = build_engine_config("m", tensor_parallel_size=2, num_threads=6, threads_per_rank=1)
    assert config_for_ranks(config).num_threads == 1
    assert config_for_ranks(build_engine_config("m", num_threads=6)).num_threads == 6
