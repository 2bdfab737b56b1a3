"""Steps that finish prompts beside other work, run in two passes (``core/first_token_pass.py``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.core.engine_core import EngineCore
from tokenmill.core.first_token_pass import split_first_tokens
from tokenmill.core.step_io import ScheduledRequest, SchedulerOutput
from tokenmill.protocol import EngineCoreRequest


@pytest.fixture(scope="module")
def model(tiny_model):  # type: ignore[no-untyped-def]
    return tiny_model("llama")


def entry(request_id: str, num_tokens: int, start: int, sample: bool, outputs: list[int]) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=request_id,
        token_ids=[5] * num_tokens,
        start_position=start,
        block_table=[0, 1, 2, 3],
        sample=sample,
        sampling_params=SamplingParams(),
        prompt_token_ids=[5] * 8,
        output_token_ids=outputs,
        forbidden_token_ids=[],
        prompt_logprobs_range=None,
        seed=None,
    )


def test_split_puts_the_prompts_a_step_finishes_first() -> None:
    decode = entry("decode", 1, 12, True, [7, 7, 7, 7])
    chunk = entry("chunk", 4, 0, False, [])  # a prompt's first chunk: no token yet
    finishing = entry("finishing", 6, 2, True, [])
    resumed = entry("resumed", 9, 0, True, [7])  # recomputed after preemption: not a first token
    plan = SchedulerOutput(
        scheduled=[decode, chunk, finishing, resumed], finished_request_ids=["gone"], num_preempted=1
    )
    passes = split_first_tokens(plan)
    assert passes is not None
    first, rest = passes
    assert [e.request_id for e in first.scheduled] == ["finishing"]
    assert first.finished_request_ids == ["gone"] and first.num_preempted == 1
    assert [e.request_id for e in rest.scheduled] == ["decode", "chunk", "resumed"]
    assert rest.finished_request_ids == [] and rest.num_preempted == 0 and not rest.interruptible


def test_plans_that_gain_nothing_or_cannot_be_split_run_whole() -> None:
    decode = entry("decode", 1, 12, True, [7])
    finishing = entry("finishing", 6, 2, True, [])
    other = entry("other", 3, 5, True, [])
    assert split_first_tokens(SchedulerOutput(scheduled=[decode])) is None
    assert split_first_tokens(SchedulerOutput(scheduled=[finishing, other])) is None
    assert (
        split_first_tokens(SchedulerOutput(scheduled=[finishing, decode], first_token_exclusive=True)) is None
    )
    # Two requests waiting behind the step would each wait for a second pass too: one pass.
    assert split_first_tokens(SchedulerOutput(scheduled=[finishing, decode]), num_waiting=1) is not None
    assert split_first_tokens(SchedulerOutput(scheduled=[finishing, decode]), num_waiting=2) is None
    # "finishing" attends to blocks "chunk" computes in this step: "chunk" must not run after it.
    chunk = entry("chunk", 8, 0, False, [])
    shared = SchedulerOutput(scheduled=[chunk, finishing, decode], shared_sources=["chunk"])
    assert split_first_tokens(shared) is None
    # A source that finishes its own prompt goes in the first pass with the request sharing it.
    source = entry("source", 8, 0, True, [])
    passes = split_first_tokens(
        SchedulerOutput(scheduled=[source, finishing, decode], shared_sources=["source"])
    )
    assert passes is not None
    assert [e.request_id for e in passes[0].scheduled] == ["source", "finishing"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def request(request_id: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling_params=greedy(max_tokens)
    )


def tiny_llm(model, **overrides: object) -> LLM:  # type: ignore[no-untyped-def]
    """The tiny model in float32 over 4-token blocks, seed 0, with the first-token pass on and 96
    blocks unless ``overrides`` say otherwise."""
    settings: dict[str, object] = {"num_blocks": 96, "first_token_pass": True, **overrides}
    return LLM(model.path, dtype="float32", block_size=4, seed=0, **settings)


def stepper(core: EngineCore, tokens: dict[str, list[int]]) -> Callable[[], list[str]]:
    """One ``core.step()`` a call: appends each output's tokens to ``tokens`` and returns the ids
    that had outputs, sorted."""

    def step() -> list[str]:
        outputs = core.step().outputs
        for output in outputs:
            tokens[output.request_id].extend(output.new_token_ids)
        return sorted(output.request_id for output in outputs)

    return step


def test_a_new_prompt_gets_its_first_token_before_the_decodes_run(model) -> None:  # type: ignore[no-untyped-def]
    """Two requests decode; a third arrives. Its step runs as two passes: the first returns only the
    new request's first token, the second the decodes' tokens. Every token equals the reference."""
    llm = tiny_llm(model)
    core = llm.engine
    prompts = {
        "a": [11 + i for i in range(9)],
        "b": [40 + i for i in range(5)],
        "c": [70 + i for i in range(13)],
    }
    tokens: dict[str, list[int]] = {name: [] for name in prompts}
    step = stepper(core, tokens)

    core.add_request(request("a", prompts["a"], 6))
    core.add_request(request("b", prompts["b"], 6))
    assert step() == ["a", "b"]  # nothing else runs: one pass
    assert step() == ["a", "b"]
    core.add_request(request("c", prompts["c"], 6))
    assert step() == ["c"]  # the first pass: c's prompt alone
    assert step() == ["a", "b"]  # the second pass of the same step, no new plan
    assert core.num_split_steps == 1
    while core.has_unfinished_requests():
        step()
    assert tokens == {name: model.greedy(prompt, 6) for name, prompt in prompts.items()}


def test_a_step_with_requests_waiting_behind_it_runs_whole(model) -> None:  # type: ignore[no-untyped-def]
    """Seats for three: a and b decode, c is admitted while d and e wait for seats. A second pass
    would delay them both, so c's step runs as one pass; once none waits, steps split again."""
    llm = tiny_llm(model, max_num_seqs=3)
    core = llm.engine
    prompts = {name: [10 * k + 3 + i for i in range(5 + k)] for k, name in enumerate("abcde")}
    tokens: dict[str, list[int]] = {name: [] for name in prompts}
    step = stepper(core, tokens)

    core.add_request(request("a", prompts["a"], 3))
    core.add_request(request("b", prompts["b"], 3))
    assert step() == ["a", "b"]
    for name in "cde":
        core.add_request(request(name, prompts[name], 3))
    assert step() == ["a", "b", "c"]  # two wait behind it: one pass
    assert core.num_split_steps == 0
    assert step() == ["a", "b", "c"]  # a and b finish
    assert step() == ["d", "e"]  # both admitted, none waits: their first tokens first,
    assert step() == ["c"]  # then c's decode as the second pass
    assert core.num_split_steps == 1
    while core.has_unfinished_requests():
        step()
    assert tokens == {name: model.greedy(prompt, 3) for name, prompt in prompts.items()}


def test_a_request_aborted_between_the_passes_is_left_out_of_the_second(model) -> None:  # type: ignore[no-untyped-def]
    llm = tiny_llm(model)
    core = llm.engine
    core.add_request(request("a", [11 + i for i in range(9)], 8))
    core.add_request(request("b", [40 + i for i in range(5)], 8))
    core.step()
    core.add_request(request("c", [70 + i for i in range(13)], 3))
    assert [o.request_id for o in core.step().outputs] == ["c"]
    assert core.abort_requests(["a"]) == ["a"]
    assert [o.request_id for o in core.step().outputs] == ["b"]
    while core.has_unfinished_requests():
        assert "a" not in [o.request_id for o in core.step().outputs]


def test_outputs_equal_the_one_pass_engine_under_chunking_and_preemption(model) -> None:  # type: ignore[no-untyped-def]
    """Many prompts through a small token budget and a pool small enough to preempt: the same tokens
    with and without the first-token pass, and the reference's."""
    prompts = [[(13 * k + 7 * i) % 90 + 5 for i in range(6 + 5 * k)] for k in range(8)]
    results = {}
    for split in (False, True):
        llm = tiny_llm(
            model, num_blocks=40, max_num_batched_tokens=24, max_num_seqs=4, first_token_pass=split
        )
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(10), use_tqdm=False)
        results[split] = [o.outputs[0].token_ids for o in outputs]
        if split:
            assert llm.engine.scheduler.num_preemptions_total > 0
            assert llm.engine.num_split_steps > 0
    assert results[True] == results[False] == [model.greedy(p, 10) for p in prompts]
