"""Pausing generation (abort / in_place / retract) and releasing memory, with requests in flight.

Each test drives the engine core step by step through an ``LLM``'s processors, so requests are
truly in flight when the pause comes. Nothing is lost or hangs: every request ends (with its
partial output under ``abort``), and afterwards every block is free or held by the prefix tree.
"""

from __future__ import annotations

import pytest

from tests.conftest import TinyModel
from tests.unit.rl_helpers import PROMPT, fixture_weights_a, fixture_weights_b, greedy, hf_state, make_llm  # noqa: F401
from tokenmill import LLM
from tokenmill.core.client import UtilityCallError
from tokenmill.frontend.output_processor import RequestState
from tokenmill.protocol import UtilityBytes
from tokenmill.worker.weight_update import serialize_named_tensors

PROMPTS = [PROMPT, [30 + i for i in range(7)], [60 + 2 * i for i in range(10)]]


def start(llm: LLM, prompts: list[list[int]], max_tokens: int = 8) -> list[RequestState]:
    states = []
    for index, prompt in enumerate(prompts):
        [request] = llm.input_processor.make_requests(f"r{index}", prompt, greedy(max_tokens))
        states.append(llm.output_processor.add_request(f"r{index}", None, prompt, greedy(max_tokens)))
        llm.engine.add_request(request)
    return states


def step(llm: LLM, times: int = 1) -> None:
    for _ in range(times):
        llm.output_processor.process(llm.engine.step().outputs)


def drain(llm: LLM, states: list[RequestState], max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if all(s.finished for s in states):
            return
        step(llm)
    raise AssertionError("requests did not finish")


def assert_blocks_back(llm: LLM) -> None:
    kv = llm.engine.kv_manager
    kv.check_integrity()
    assert kv.all_free_or_cached()


def test_abort_returns_partial_outputs_and_a_new_request_waits(weights_a: TinyModel) -> None:
    llm = make_llm(weights_a)
    states = start(llm, PROMPTS)
    step(llm, 3)
    produced = [len(s.samples[0].token_ids) for s in states]
    assert all(0 < n < 8 for n in produced)
    result = llm.pause_generation("abort")
    assert result["num_aborted"] == 3
    step(llm)  # the aborts' outputs come with the next (empty) step
    for state, n in zip(states, produced):
        sample = state.samples[0]
        assert sample.finish_reason == "abort" and len(sample.token_ids) == n
        assert sample.token_ids == weights_a.greedy(state.prompt_token_ids, n)
    assert_blocks_back(llm)
    # Arriving while paused: admitted, but no step runs until continue_generation.
    [late] = start(llm, [PROMPT])
    assert not llm.engine.has_unfinished_requests()
    step(llm, 3)
    assert late.samples[0].token_ids == []
    with pytest.raises(ValueError, match="paused"):
        llm.generate([{"prompt_token_ids": PROMPT}], greedy(), use_tqdm=False)
    llm.continue_generation()
    drain(llm, [late])
    assert late.samples[0].token_ids == weights_a.greedy(PROMPT, 8)
    assert_blocks_back(llm)


def test_in_place_freezes_and_new_weights_apply_from_the_next_token(
    weights_a: TinyModel, weights_b: TinyModel
) -> None:
    llm = make_llm(weights_a)
    states = start(llm, PROMPTS)
    step(llm, 3)
    assert llm.pause_generation("in_place")["num_frozen"] == 3
    frozen = [list(s.samples[0].token_ids) for s in states]
    in_use = llm.kv_stats()["blocks_in_use"]
    step(llm, 4)
    assert [s.samples[0].token_ids for s in states] == frozen  # nothing moves, KV kept
    assert llm.kv_stats()["blocks_in_use"] == in_use
    llm.update_weights_from_tensor(hf_state(weights_b), weight_version="b")
    llm.continue_generation()
    drain(llm, states)
    for state, before in zip(states, frozen):
        sample = state.samples[0]
        assert sample.token_ids[: len(before)] == before
        assert sample.weight_versions == ["default"] * len(before) + ["b"] * (8 - len(before))
        assert sample.finish_reason == "length"
    assert_blocks_back(llm)


def test_in_place_without_an_update_changes_nothing(weights_a: TinyModel) -> None:
    llm = make_llm(weights_a)
    states = start(llm, PROMPTS)
    step(llm, 2)
    llm.pause_generation("in_place")
    step(llm, 2)
    llm.continue_generation()
    drain(llm, states)
    for state in states:
        assert state.samples[0].token_ids == weights_a.greedy(state.prompt_token_ids, 8)
    assert_blocks_back(llm)


def test_retract_frees_kv_and_recomputes_under_the_new_weights(
    weights_a: TinyModel, weights_b: TinyModel
) -> None:
    """Retracted requests hold no blocks while paused; on continue their prompt and tokens so far
    are recomputed under B, so the rest is exactly B's continuation of that text."""
    llm = make_llm(weights_a)
    states = start(llm, PROMPTS)
    step(llm, 3)
    result = llm.pause_generation("retract")
    assert result["num_retracted"] == 3 and result["num_frozen"] == 0
    assert llm.kv_stats()["blocks_in_use"] == 0
    assert_blocks_back(llm)
    before = [list(s.samples[0].token_ids) for s in states]
    llm.update_weights_from_tensor(hf_state(weights_b))
    llm.continue_generation()
    drain(llm, states)
    for state, head in zip(states, before):
        tokens = state.samples[0].token_ids
        assert tokens[: len(head)] == head
        assert tokens[len(head) :] == weights_b.greedy(state.prompt_token_ids + head, 8 - len(head))
    assert_blocks_back(llm)


def test_bad_pause_mode(weights_a: TinyModel) -> None:
    llm = make_llm(weights_a)
    with pytest.raises(UtilityCallError, match="mode must be one of abort, in_place, retract"):
        llm.pause_generation("sideways")
    assert not llm.engine.pause.paused


def test_release_and_resume_memory(weights_a: TinyModel, weights_b: TinyModel) -> None:
    llm = make_llm(weights_a)
    runner = llm.engine.executor.runner  # type: ignore[attr-defined]
    states = start(llm, PROMPTS[:2])
    step(llm, 2)
    llm.pause_generation("in_place")
    with pytest.raises(UtilityCallError, match="pause_generation with mode 'abort' or 'retract' first"):
        llm.release_memory_occupation()
    llm.continue_generation()
    llm.pause_generation("retract")
    llm.release_memory_occupation()
    assert runner.kv_caches == [] and all(p.numel() == 0 for p in runner.model.parameters())
    with pytest.raises(ValueError, match="memory is released"):
        llm.engine.add_request(llm.input_processor.make_requests("x", PROMPT, greedy())[0])
    with pytest.raises(UtilityCallError, match="weights are released"):
        llm.update_weights_from_disk(weights_b.path)
    llm.resume_memory_occupation(["kv_cache"])
    assert llm.engine.pause.blocks_steps  # the weights are still out
    llm.resume_memory_occupation(["weights"])
    llm.continue_generation()
    drain(llm, states)
    for state in states:
        assert state.samples[0].token_ids == weights_a.greedy(state.prompt_token_ids, 8)
    assert_blocks_back(llm)
    # After a release of the KV cache alone, the new cache holds nothing stale.
    llm.pause_generation("abort")
    llm.release_memory_occupation(["kv_cache"])
    llm.resume_memory_occupation(["kv_cache"])
    llm.continue_generation()
    out = llm.generate([{"prompt_token_ids": PROMPT}], greedy(8), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == weights_a.greedy(PROMPT, 8)


def test_update_with_abort_all_requests_ends_them_first(weights_a: TinyModel, weights_b: TinyModel) -> None:
    """SGLang's ``abort_all_requests``: no request runs across the update."""
    llm = make_llm(weights_a)
    states = start(llm, PROMPTS)
    step(llm, 2)
    llm.call_utility(
        "update_weights_from_tensor",
        serialized_named_tensors=UtilityBytes(serialize_named_tensors(hf_state(weights_b))),
        abort_all_requests=True,
    )
    step(llm)
    assert [s.samples[0].finish_reason for s in states] == ["abort"] * 3
    assert all(set(s.samples[0].weight_versions) == {"default"} for s in states)
    assert_blocks_back(llm)
    with pytest.raises(ValueError, match="paused"):
        llm.pause_generation("in_place")
        list(llm.stream({"prompt_token_ids": PROMPT}, greedy()))
