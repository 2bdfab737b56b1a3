"""Steps paused between layers for arrivals with short prefills (``step_control.py``).

Scheduler-level with the fake model of ``test_scheduler``: which plans may pause, and what the
arrivals' pass (``Scheduler.schedule_beside``) admits while one is paused. Then through the engine
on the layer modules of the tiny Llama and of a tiny Gemma 3: a step paused before an inner layer
goes on from there after the arrivals' pass, every token equal to the transformers reference, and
aborts wait for it.
"""

from __future__ import annotations

import pytest
from test_first_token_pass import request, stepper, tiny_llm
from test_scheduler import prompt_of
from test_tiers import TierHarness, ids

from tests.conftest import TinyModel, save_tiny_model
from tests.models.test_gemma3 import GEMMA3
from tokenmill.config import TierConfig
from tokenmill.core.request import RequestStatus
from tokenmill.step_control import InterruptFlag


def test_steps_may_pause_unless_they_finish_a_short_prefill_and_the_arrivals_pass_admits_short_ones() -> None:
    h = TierHarness(budget=64, short_prefill_interrupt=8, prefix_caching=True)
    h.add("a", prompt_of(20, 1), max_tokens=8)
    plan = h.scheduler.schedule()
    assert ids(plan) == ["a"] and plan.pausable and not plan.interruptible  # a long prompt
    h.finish_step(plan)
    paused = h.scheduler.schedule()
    assert ids(paused) == ["a"] and paused.pausable  # a's first decode
    # Arrivals while it is paused: b is short, c is long, d shares a's 16 cached prompt tokens and
    # needs 3 more.
    h.add("b", prompt_of(6, 300), max_tokens=4)
    h.add("c", prompt_of(20, 600), max_tokens=4)
    h.add("d", prompt_of(20, 1)[:16] + [5, 6, 7], max_tokens=4)
    beside = h.scheduler.schedule_beside()
    assert [(e.request_id, e.start_position, len(e.token_ids), e.sample) for e in beside.scheduled] == [
        ("b", 0, 6, True),
        ("d", 16, 3, True),
    ]
    assert not beside.pausable and not beside.interruptible
    h.finish_step(beside)
    assert len(h.outputs["b"]) == len(h.outputs["d"]) == 1  # first tokens before the paused step ends
    assert h.outputs["a"] == [h.outputs["a"][0]]
    h.finish_step(paused)
    assert len(h.outputs["a"]) == 2
    plan = h.scheduler.schedule()
    assert ids(plan) == ["a", "b", "d", "c"] and plan.pausable  # c's long prompt finishes in it
    h.finish_step(plan)
    h.add("e", prompt_of(5, 900), max_tokens=2)
    plan = h.scheduler.schedule()
    assert "e" in ids(plan) and not plan.pausable  # e's short prompt finishes in it
    h.finish_step(plan)
    h.run()
    h.assert_outputs_match_reference()

    # A first token a tier's TTFT target protects never waits for the arrivals' pass, long as its
    # prompt is; the tier's other steps may pause.
    h = TierHarness(
        budget=64,
        short_prefill_interrupt=8,
        tiers=[TierConfig("priority", ttft_slo=0.1), TierConfig("default")],
    )
    h.add("vip", prompt_of(20, 1), max_tokens=3, service_tier="priority")
    plan = h.scheduler.schedule()
    assert ids(plan) == ["vip"] and not plan.pausable
    h.finish_step(plan)
    assert h.scheduler.schedule().pausable  # its decode
    h.run()
    h.assert_outputs_match_reference()

    # Without short_prefill_interrupt no step pauses.
    h = TierHarness(budget=64)
    h.add("a", prompt_of(20, 1), max_tokens=2)
    assert not h.scheduler.schedule().pausable


def test_the_arrivals_pass_never_preempts_nor_joins_prefixes_in_flight() -> None:
    # Six blocks of 4 tokens: a holds five once it decodes, b's 8 tokens need two.
    h = TierHarness(num_blocks=6, budget=64, short_prefill_interrupt=8)
    h.add("a", prompt_of(16, 1), max_tokens=8)
    h.finish_step(h.scheduler.schedule())
    paused = h.scheduler.schedule()
    h.add("b", prompt_of(8, 300), max_tokens=2)
    free = h.kv.pool.num_free
    assert h.scheduler.schedule_beside().is_empty
    assert h.kv.pool.num_free == free and h.scheduler.num_waiting == 1  # b waits, a keeps its blocks
    h.finish_step(paused)
    h.run()
    h.assert_outputs_match_reference()

    # The pass keeps to the step's token budget: of two 6-token prompts, one fits in 10 tokens.
    h = TierHarness(budget=10, short_prefill_interrupt=8)
    h.add("a", prompt_of(9, 1), max_tokens=4)
    h.finish_step(h.scheduler.schedule())
    paused = h.scheduler.schedule()
    h.add("b", prompt_of(6, 300), max_tokens=2)
    h.add("c", prompt_of(6, 500), max_tokens=2)
    beside = h.scheduler.schedule_beside()
    assert ids(beside) == ["b"]
    h.finish_step(beside)
    h.finish_step(paused)
    h.run()
    h.assert_outputs_match_reference()

    # c's prompt computes the blocks e would share: e waits for them rather than compute them again.
    h = TierHarness(budget=8, short_prefill_interrupt=8, prefix_caching=True)
    shared = prompt_of(16, 50)
    h.add("c", shared + [1, 2], max_tokens=2)
    paused = h.scheduler.schedule()  # c's first chunk of 8
    h.add("e", shared + [3], max_tokens=2)
    h.add("f", prompt_of(4, 700), max_tokens=2)
    assert ids(h.scheduler.schedule_beside()) == ["f"]
    h.run()
    h.assert_outputs_match_reference()


def test_ttft_admission_gives_arrivals_a_pass_each_when_their_tokens_outweigh_a_pass() -> None:
    def trained(fixed: float, per_token: float) -> TierHarness:
        """A paused decode step, the step-time model trained on steps of ``fixed + per_token`` each."""
        h = TierHarness(
            budget=64,
            short_prefill_interrupt=8,
            admission="ttft",
            seconds_per_step=lambda plan: fixed + per_token * plan.num_tokens,
        )
        h.add("a", prompt_of(20, 1), max_tokens=12)
        for _ in range(6):
            h.finish_step(h.scheduler.schedule())
        assert h.scheduler.step_time.coefficients is not None
        return h

    # A pass costs little beside the arrivals' 6 tokens each: one arrival a pass (the mean wait of two
    # is 1.5 prefills instead of 2), the second in the next pass.
    h = trained(0.001, 0.001)
    paused = h.scheduler.schedule()
    h.add("b", prompt_of(6, 300), max_tokens=2)
    h.add("c", prompt_of(6, 500), max_tokens=2)
    first = h.scheduler.schedule_beside()
    assert ids(first) == ["b"]
    h.finish_step(first)
    second = h.scheduler.schedule_beside()
    assert ids(second) == ["c"]
    h.finish_step(second)
    assert h.scheduler.schedule_beside().is_empty  # then the paused step goes on
    h.finish_step(paused)
    h.run()
    h.assert_outputs_match_reference()

    # A pass's fixed cost dwarfs the arrivals' tokens: both in one pass.
    h = trained(0.1, 0.0001)
    paused = h.scheduler.schedule()
    h.add("b", prompt_of(6, 300), max_tokens=2)
    h.add("c", prompt_of(6, 500), max_tokens=2)
    assert ids(h.scheduler.schedule_beside()) == ["b", "c"]


def test_lpm_puts_back_a_barely_started_prompt_for_a_burst_that_shares_a_new_prefix() -> None:
    h = TierHarness(budget=24, short_prefill_interrupt=8, prefix_caching=True, policy="lpm")
    h.add("a", prompt_of(20, 1), max_tokens=3)
    started = h.scheduler.schedule()
    assert ids(started) == ["a"] and started.pausable
    # While a's first step is paused, three requests sharing a 16-token prefix of their own arrive:
    # the first of them to run computes it for all three.
    shared = prompt_of(16, 500)
    for name, tail in (("b", [1, 2]), ("c", [3, 4]), ("d", [5, 6])):
        h.add(name, shared + tail, max_tokens=3)
    assert not h.scheduler.replan_paused(started, fraction_done=0.5)  # too much of it has run
    assert h.scheduler.replan_paused(started, fraction_done=0.0)
    a = h.scheduler.requests["a"]
    assert a.status == RequestStatus.WAITING and a.num_computed_tokens == 0
    assert h.kv.pool.num_free == h.kv.num_blocks  # its blocks are back (nothing of it was cached)
    plan = h.scheduler.schedule()
    # b computes the shared prefix first, c and d attend to it in the same step; a's prompt takes
    # what is left of the budget.
    assert [(e.request_id, e.start_position, len(e.token_ids)) for e in plan.scheduled] == [
        ("b", 0, 18),
        ("c", 16, 2),
        ("d", 16, 2),
        ("a", 0, 2),
    ]
    assert not h.scheduler.replan_paused(plan, fraction_done=0.0)  # a is put back at most once
    h.finish_step(plan)
    h.run()
    h.assert_outputs_match_reference()

    # Only lpm reorders started work; nor is a step with a decode or a later chunk ever put back.
    for policy in ("fcfs", "lpm"):
        h = TierHarness(budget=24, short_prefill_interrupt=8, prefix_caching=True, policy=policy)
        h.add("a", prompt_of(30, 1), max_tokens=3)
        first_chunk = h.scheduler.schedule()
        for name, tail in (("b", [1, 2]), ("c", [3, 4])):
            h.add(name, shared + tail, max_tokens=3)
        assert h.scheduler.replan_paused(first_chunk, fraction_done=0.0) == (policy == "lpm")
        if policy == "lpm":
            h.finish_step(h.scheduler.schedule())  # b's prompt, a's first chunk
            h.add("e", shared + [7, 8], max_tokens=3)
            h.add("f", shared + [9, 10], max_tokens=3)
            later = h.scheduler.schedule()  # b's first decode, a's second chunk and others
            assert not h.scheduler.replan_paused(later, fraction_done=0.0)
            h.finish_step(later)
        h.run()
        h.assert_outputs_match_reference()


@pytest.fixture(scope="module")
def model(tiny_model):  # type: ignore[no-untyped-def]
    return tiny_model("llama")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The tiny Gemma 3 of ``tests/models/test_gemma3.py`` (sliding and global layers)."""
    folder = str(tmp_path_factory.mktemp("tiny-gemma3-paused"))
    return TinyModel(arch="gemma3_text", path=folder, hf=save_tiny_model(GEMMA3, seed=31, folder=folder))


def paused_engine(model, tmp_path, monkeypatch: pytest.MonkeyPatch, **overrides: object):  # type: ignore[no-untyped-def]
    """The tiny model on its layer modules with short-prefill pauses on (and ``overrides``), its
    interrupt flag, a list that raises the flag while layer 0 runs when it holds an entry (as an
    arrival would), and the count of layer 0's runs."""
    llm = tiny_llm(model, short_prefill_interrupt=8, **overrides)
    core = llm.engine
    net = core.executor.runner.model
    if hasattr(net, "decode_stack"):
        net.decode_stack = None  # the layer modules, whose checks between layers the test can time
    flag = InterruptFlag.create(str(tmp_path))
    core.set_interrupt(flag)
    first_layer = net.layers[0]
    forward = first_layer.forward
    arm: list[bool] = []
    layer_0_runs: list[int] = []

    def raising(*args, **kwargs):  # type: ignore[no-untyped-def]
        layer_0_runs.append(1)
        if arm:
            arm.clear()
            flag.raise_()
        return forward(*args, **kwargs)

    monkeypatch.setattr(first_layer, "forward", raising)
    return core, flag, arm, layer_0_runs


@pytest.fixture(params=["model", "gemma3"])
def llama_or_gemma3(request: pytest.FixtureRequest) -> TinyModel:
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


@pytest.mark.parametrize("arrivals", [["b"], ["b", "c"]])
def test_a_step_paused_between_layers_goes_on_from_there_after_the_arrivals_passes(
    llama_or_gemma3: TinyModel,
    arrivals: list[str],
    tmp_path,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the arrivals' pass admitting one request at a time, each arrival gets a pass of its own
    before the paused decode goes on."""
    model = llama_or_gemma3
    core, flag, arm, layer_0_runs = paused_engine(model, tmp_path, monkeypatch)
    monkeypatch.setattr(core.scheduler, "_arrival_pass_cap", lambda: 1)
    every_prompt = {
        "a": [11 + i for i in range(13)],
        "b": [40 + i for i in range(5)],
        "c": [70 + i for i in range(6)],
    }
    prompts = {name: every_prompt[name] for name in ["a", *arrivals]}
    tokens: dict[str, list[int]] = {name: [] for name in prompts}
    step = stepper(core, tokens)
    core.add_request(request("a", prompts["a"], 6))
    assert step() == ["a"]
    arm.append(True)
    assert step() == []  # a's first decode pauses before layer 1
    assert core.num_paused_steps == 1 and core.has_unfinished_requests()
    flag.clear()  # as the engine loop does before it reads its input
    for name in arrivals:
        core.add_request(request(name, prompts[name], 6))
    layer_0_runs.clear()
    for name in arrivals:
        assert step() == [name]  # an arrivals' pass: its first token
    assert step() == ["a"]  # the paused decode goes on from layer 1
    assert len(layer_0_runs) == len(arrivals)  # the arrivals' passes only
    while core.has_unfinished_requests():
        step()
    assert tokens == {name: model.greedy(prompt, 6) for name, prompt in prompts.items()}
    assert core.kv_manager.all_free_or_cached()


def test_a_request_aborted_while_its_step_is_paused_ends_when_the_step_has(
    model,  # type: ignore[no-untyped-def]
    tmp_path,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    core, flag, arm, _ = paused_engine(model, tmp_path, monkeypatch)
    prompts = {
        "a": [11 + i for i in range(13)],
        "b": [40 + i for i in range(5)],
        "c": [90 + i for i in range(9)],
    }
    tokens: dict[str, list[int]] = {name: [] for name in prompts}
    step = stepper(core, tokens)
    core.add_request(request("a", prompts["a"], 6))
    core.add_request(request("c", prompts["c"], 6))
    assert step() == ["a", "c"]
    arm.append(True)
    assert step() == []  # paused
    flag.clear()
    # a's blocks are the paused step's to write until it ends: the abort waits for it.
    core.abort_requests(["a"])
    assert "a" in core.scheduler.requests
    core.add_request(request("b", prompts["b"], 6))
    assert step() == ["b"]
    assert step() == ["c"]  # the paused step ends; a is aborted before its results count
    assert "a" not in core.scheduler.requests
    while core.has_unfinished_requests():
        step()
    assert tokens["a"] == model.greedy(prompts["a"], 1)
    assert {name: tokens[name] for name in "bc"} == {name: model.greedy(prompts[name], 6) for name in "bc"}
    core.kv_manager.check_integrity()
    assert core.kv_manager.all_free_or_cached()


@pytest.mark.parametrize("ran_longer_than_predicted", [False, True])
def test_lpm_runs_a_burst_sharing_a_new_prefix_before_the_prompt_that_started_just_ahead_of_it(
    model,  # type: ignore[no-untyped-def]
    tmp_path,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
    ran_longer_than_predicted: bool,
) -> None:
    """a's step pauses before its first layer ends; a burst sharing a new prefix arrived. It is put
    back and the burst goes first, unless a's step already ran longer than a whole step is predicted
    to take (a cold step's first layers are slow): that time would be lost, so it goes on."""
    core, flag, _, layer_0_runs = paused_engine(
        model, tmp_path, monkeypatch, policy="lpm", max_num_batched_tokens=24
    )
    if ran_longer_than_predicted:
        for num_tokens, num_seqs in ((1, 1), (8, 2), (20, 1), (4, 4), (16, 3), (2, 1)):
            core.scheduler.step_time.observe(num_tokens, num_seqs, 1e-7)  # every step predicted ~instant
    shared = [100 + i for i in range(16)]
    prompts = {
        "a": [11 + i for i in range(20)],
        "b": shared + [1, 2],
        "c": shared + [3, 4],
        "d": shared + [5, 6],
    }
    tokens: dict[str, list[int]] = {name: [] for name in prompts}
    step = stepper(core, tokens)
    core.add_request(request("a", prompts["a"], 4))
    flag.raise_()  # raised by the burst's first request: a's step stops before its first layer
    assert step() == []
    assert core.num_paused_steps == 1
    flag.clear()
    for name in "bcd":
        core.add_request(request(name, prompts[name], 4))
    layer_0_runs.clear()
    if ran_longer_than_predicted:
        assert step() == ["a"]  # it went on
        assert core.num_replanned_steps == 0
    else:
        # a's step was put back: the burst's first tokens come first (b computes the prefix they share).
        assert step() == ["b", "c", "d"]
        assert core.num_replanned_steps == 1 and len(layer_0_runs) == 1
    while core.has_unfinished_requests():
        step()
    assert core.num_replanned_steps == (0 if ran_longer_than_predicted else 1)
    assert tokens == {name: model.greedy(prompt, 4) for name, prompt in prompts.items()}
    core.kv_manager.check_integrity()
    assert core.kv_manager.all_free_or_cached()


def test_arrivals_during_a_first_token_pass_go_before_the_steps_second_pass(model) -> None:  # type: ignore[no-untyped-def]
    """a and b decode; c's step runs its first token first. d, a short prompt, arrives during that
    pass: the second pass (a's and b's decodes) would have paused for it at its first layer, so d's
    pass runs before it, as it would then."""
    core = tiny_llm(model, short_prefill_interrupt=8).engine
    prompts = {
        "a": [11 + i for i in range(9)],
        "b": [40 + i for i in range(5)],
        "c": [70 + i for i in range(13)],
        "d": [90 + i for i in range(6)],
    }
    tokens: dict[str, list[int]] = {name: [] for name in prompts}
    step = stepper(core, tokens)
    core.add_request(request("a", prompts["a"], 6))
    core.add_request(request("b", prompts["b"], 6))
    assert step() == ["a", "b"]
    core.add_request(request("c", prompts["c"], 6))
    assert step() == ["c"]  # the first pass
    core.add_request(request("d", prompts["d"], 6))
    assert step() == ["d"]  # d's pass
    assert step() == ["a", "b"]  # then the second pass of c's step
    assert core.num_split_steps == 1
    while core.has_unfinished_requests():
        step()
    assert tokens == {name: model.greedy(prompt, 6) for name, prompt in prompts.items()}
    core.kv_manager.check_integrity()
    assert core.kv_manager.all_free_or_cached()
