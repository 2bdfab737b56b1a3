"""The multi-process executor (``executor/multiproc.py``): the same runner in one child process, plans
sent as deltas. Through it the tiny Llama gives what the in-process executor gives, with chunked
prefill, prefix caching, n > 1 and seeded sampling; a step paused between layers goes on from there
in the worker; a worker that fails to start or dies is a clear error, never a hang.
"""

from __future__ import annotations

import argparse
import os
import signal

import pytest
from test_first_token_pass import request, stepper, tiny_llm

from tests.conftest import TinyModel
from tokenmill import LLM, SamplingParams
from tokenmill.config import build_engine_config
from tokenmill.core.engine_core import EngineCore
from tokenmill.engine_args import add_engine_args, engine_kwargs
from tokenmill.executor.multiproc import MultiProcessExecutor, WorkerProcessError
from tokenmill.loader import resolve_model
from tokenmill.step_control import InterruptFlag


@pytest.fixture(scope="module")
def model(tiny_model) -> TinyModel:  # type: ignore[no-untyped-def]
    return tiny_model("llama")


def generate_all(llm: LLM) -> list[list[list[int]]]:
    """Greedy and seeded n = 2 requests sharing a prefix, under a 16-token budget (chunked prefill)."""
    shared = [11 + i for i in range(12)]
    prompts = [shared + [3, 4, 5], shared + [6, 7], [40 + i for i in range(21)]]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    seeded = SamplingParams(
        temperature=0.9, top_p=0.9, seed=7, n=2, max_tokens=6, ignore_eos=True, logprobs=2
    )
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts] * 2, [greedy] * 3 + [seeded] * 3, use_tqdm=False
    )
    return [[completion.token_ids for completion in output.outputs] for output in outputs]


def test_the_tiny_llama_through_the_worker_process_equals_the_in_process_executor(model: TinyModel) -> None:
    settings: dict[str, object] = {
        "max_num_batched_tokens": 16,
        "enable_prefix_caching": True,
        "num_threads": 1,
    }
    in_process = tiny_llm(model, **settings)
    expected = generate_all(in_process)
    mp = tiny_llm(model, executor_backend="mp", **settings)
    executor = mp.engine.executor
    assert isinstance(executor, MultiProcessExecutor)
    assert executor.num_blocks == in_process.engine.executor.num_blocks
    try:
        assert generate_all(mp) == expected
        shared = [11 + i for i in range(12)]
        assert expected[0] == [model.greedy(shared + [3, 4, 5], 6)]
        assert mp.engine.kv_manager.prefix_hit_tokens > 0
        assert executor.collective_rpc("prefault_while_idle") in ([True], [False])
        with pytest.raises(RuntimeError, match="no public method") as failed:
            executor.collective_rpc("_build_batch")
        assert not isinstance(failed.value, WorkerProcessError)  # the worker serves on
        assert executor.collective_rpc("prefault_while_idle") in ([True], [False])
        assert mp.engine.kv_manager.all_free_or_cached()
    finally:
        executor.shutdown()
    assert executor._processes[0].poll() is not None  # the worker exited
    with pytest.raises(WorkerProcessError):
        executor.execute(mp.engine.scheduler.schedule())


def test_a_step_paused_in_the_worker_goes_on_there_after_the_arrivals_pass(
    model: TinyModel, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    llm = tiny_llm(model, short_prefill_interrupt=8, executor_backend="mp", num_threads=1)
    core = llm.engine
    flag = InterruptFlag.create(str(tmp_path))
    core.set_interrupt(flag)
    prompts = {"a": [11 + i for i in range(13)], "b": [40 + i for i in range(5)]}
    tokens: dict[str, list[int]] = {name: [] for name in prompts}
    step = stepper(core, tokens)
    try:
        core.add_request(request("a", prompts["a"], 6))
        flag.raise_()  # as an arrival does: a's step stops before its first layer, in the worker
        assert step() == []
        assert core.num_paused_steps == 1 and core.has_unfinished_requests()
        flag.clear()
        core.add_request(request("b", prompts["b"], 6))
        assert step() == ["b"]  # the arrivals' pass runs beside the paused step
        assert step() == ["a"]  # the paused step goes on in the worker
        while core.has_unfinished_requests():
            step()
        assert tokens == {name: model.greedy(prompt, 6) for name, prompt in prompts.items()}
        assert core.kv_manager.all_free_or_cached()
    finally:
        core.executor.shutdown()


def test_a_worker_that_fails_to_start_or_dies_is_a_clear_error(model: TinyModel) -> None:
    # int8 weights need bfloat16: the worker's runner refuses, and says why.
    config = build_engine_config(
        model.path, dtype="float32", quantization="int8", executor_backend="mp", num_blocks=16, num_threads=1
    )
    with pytest.raises(WorkerProcessError, match="failed while starting: ValueError: quantization 'int8'"):
        EngineCore(config, resolve_model(model.path))

    config = build_engine_config(
        model.path, dtype="float32", executor_backend="mp", num_blocks=16, num_threads=1
    )
    core = EngineCore(config, resolve_model(model.path))
    executor = core.executor
    assert isinstance(executor, MultiProcessExecutor)
    os.kill(executor.worker_pid, signal.SIGKILL)
    core.add_request(request("a", [5, 6, 7], 2))
    with pytest.raises(WorkerProcessError, match=f"exited with code {-signal.SIGKILL} while running a step"):
        core.step()
    with pytest.raises(WorkerProcessError, match="exited"):
        core.step()  # stays failed
    executor.shutdown()


def test_the_executor_is_chosen_by_config_field_and_cli_flag() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert build_engine_config("m", **engine_kwargs(parser.parse_args([]))).executor_backend == "inprocess"
    args = parser.parse_args(["--executor-backend", "mp"])
    assert build_engine_config("m", **engine_kwargs(args)).executor_backend == "mp"
    with pytest.raises(ValueError, match="executor_backend must be one of"):
        build_engine_config("m", executor_backend="ray").validate()
