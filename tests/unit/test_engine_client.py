"""The engine client seam (``core/client.py``): all-or-none admission, queue refusals and utility
calls mean the same through ``LLM``'s in-process client and through the engine process's ZMQ client."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config import build_engine_config
from tokenmill.core.client import InProcClient, UtilityCallError, complete_now
from tokenmill.core.request import Request
from tokenmill.core.zmq_client import EngineLaunch
from tokenmill.protocol import RESERVED_UTILITY_METHODS, EngineCoreRequest, UtilityValue

OPTIONS: dict[str, object] = {"dtype": "float32", "block_size": 4, "num_blocks": 64}
PROMPT = [7, 21, 33, 40, 52, 61, 70, 88, 93]


def params(n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tiny_model) -> str:  # type: ignore[no-untyped-def]
    return str(tiny_model("llama").path)


@pytest.fixture(scope="module")
def llm(model_path: str) -> LLM:
    return LLM(model_path, **OPTIONS)


def assert_nothing_held(llm: LLM) -> None:
    stats = llm.kv_stats()
    assert not llm.client.has_unfinished_requests()
    assert stats["blocks_in_use"] == 0 and stats["num_waiting"] == 0 and stats["num_running"] == 0
    assert not llm.output_processor.requests


def test_a_group_whose_second_sibling_fails_leaves_nothing_behind(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler = llm.engine.scheduler
    add = scheduler.add_request

    def refuse_second_sibling(request: Request) -> None:
        if request.sibling_index == 1:
            raise ValueError("sibling 1 cannot run")
        add(request)

    monkeypatch.setattr(scheduler, "add_request", refuse_second_sibling)
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:5]}]
    # The first prompt (n=1) gets in; the second's group fails at its second sample: the call
    # raises and takes the first prompt back too.
    with pytest.raises(ValueError, match="sibling 1 cannot run"):
        llm.generate(prompts, [params(1), params(3)], use_tqdm=False)
    assert_nothing_held(llm)
    monkeypatch.undo()
    # The engine serves on as before.
    assert len(llm.generate(prompts, [params(1), params(3)], use_tqdm=False)[1].outputs) == 3


def test_engine_core_takes_back_admitted_siblings(llm: LLM) -> None:
    core = llm.engine
    first = EngineCoreRequest(request_id="g-0", prompt_token_ids=PROMPT, sampling_params=params())
    out_of_vocab = EngineCoreRequest(request_id="g-1", prompt_token_ids=[10**6], sampling_params=params())
    result = core.add_request_group([first, out_of_vocab])
    assert result.request_ids == ["g-0", "g-1"] and not result.overloaded
    assert result.error is not None and "outside the vocabulary" in result.error
    assert not core.has_unfinished_requests()


def test_a_full_waiting_queue_refuses_the_whole_call(model_path: str) -> None:
    llm = LLM(model_path, max_waiting=2, **OPTIONS)
    with pytest.raises(ValueError, match="overloaded"):
        llm.generate([{"prompt_token_ids": PROMPT}] * 2, params(2), use_tqdm=False)
    assert_nothing_held(llm)
    refused = llm.engine.add_request_group(
        [
            EngineCoreRequest(request_id=f"r-{i}", prompt_token_ids=PROMPT, sampling_params=params())
            for i in range(3)
        ]
    )
    assert refused.overloaded and refused.retry_after is not None and refused.retry_after >= 1
    assert len(llm.generate([{"prompt_token_ids": PROMPT}] * 2, params(), use_tqdm=False)) == 2


def test_utility_calls_in_process(llm: LLM) -> None:
    llm.generate([{"prompt_token_ids": PROMPT}], params(), use_tqdm=False)
    stats = llm.kv_stats()
    assert stats["num_blocks"] == 64 and stats["block_size"] == 4
    assert stats["cached_blocks"] == len(PROMPT) // 4  # the prompt's full blocks stay cached
    assert stats["free_blocks"] == 64 - stats["cached_blocks"]
    assert llm.reset_prefix_cache() is True
    assert llm.kv_stats()["cached_blocks"] == 0
    with pytest.raises(UtilityCallError, match="unknown engine method 'no_such_method'"):
        llm.call_utility("no_such_method")
    for method in RESERVED_UTILITY_METHODS:
        with pytest.raises(UtilityCallError, match="not support .* yet"):
            llm.call_utility(method)


def test_complete_now_refuses_a_call_that_waits() -> None:
    async def waits() -> None:
        await asyncio.sleep(0)

    with pytest.raises(RuntimeError, match="event loop"):
        complete_now(waits())


# ---------------------------------------------------------------- the same calls over ZMQ


@pytest.fixture(scope="module")
def zmq_answers(model_path: str) -> Iterator[dict[str, object]]:
    """What an engine process answers, through ``ZmqClient``, for the calls the in-process tests make."""

    async def ask() -> dict[str, object]:
        launch = EngineLaunch.begin(build_engine_config(model_path, **OPTIONS), log_level="WARNING")
        try:
            client = await launch.wait_ready(300)
        except BaseException:
            launch.abandon()
            raise
        answers: dict[str, object] = {}
        try:
            answers["kv_stats"] = await client.call_utility("kv_stats")
            answers["reset_prefix_cache"] = await client.call_utility("reset_prefix_cache")
            for method in ("no_such_method", *RESERVED_UTILITY_METHODS):
                try:
                    await client.call_utility(method)
                except UtilityCallError as exc:
                    answers[method] = str(exc)
            good = EngineCoreRequest(request_id="z-0", prompt_token_ids=PROMPT, sampling_params=params())
            bad = EngineCoreRequest(request_id="z-1", prompt_token_ids=[10**6], sampling_params=params())
            answers["refused"] = await client.add_request_group([good, bad])
            answers["after_refusal"] = await client.call_utility("kv_stats")
        finally:
            await client.shutdown()
        answers["dead_reason"] = client.dead_reason
        return answers

    with pytest.MonkeyPatch.context() as env:
        # The engine process inherits it: this test is about messages, not kernels, so the process
        # need not load (or wait for another process to build) the C++ attention kernel.
        env.setenv("TOKENMILL_ATTENTION_BACKEND", "torch")
        yield asyncio.run(ask())


def in_process_error(llm: LLM, method: str) -> str:
    with pytest.raises(UtilityCallError) as info:
        complete_now(InProcClient(llm.engine).call_utility(method))
    return str(info.value)


def test_both_clients_answer_utility_calls_alike(llm: LLM, zmq_answers: dict[str, object]) -> None:
    over_zmq = zmq_answers["kv_stats"]
    assert isinstance(over_zmq, dict)
    in_process: dict[str, UtilityValue] = llm.kv_stats()
    assert sorted(over_zmq) == sorted(in_process)
    assert over_zmq["num_blocks"] == in_process["num_blocks"] and over_zmq["blocks_in_use"] == 0
    assert zmq_answers["reset_prefix_cache"] == {"success": True}
    for method in ("no_such_method", *RESERVED_UTILITY_METHODS):
        assert zmq_answers[method] == in_process_error(llm, method)


def test_both_clients_admit_all_or_none_alike(llm: LLM, zmq_answers: dict[str, object]) -> None:
    refused = zmq_answers["refused"]
    good = EngineCoreRequest(request_id="z-0", prompt_token_ids=PROMPT, sampling_params=params())
    bad = EngineCoreRequest(request_id="z-1", prompt_token_ids=[10**6], sampling_params=params())
    assert refused == complete_now(InProcClient(llm.engine).add_request_group([good, bad]))
    after = zmq_answers["after_refusal"]
    assert isinstance(after, dict) and after["num_waiting"] == 0 and after["blocks_in_use"] == 0
    assert zmq_answers["dead_reason"] is not None  # shut down: later calls raise EngineDeadError
