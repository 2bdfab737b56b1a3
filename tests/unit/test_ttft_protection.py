"""The step-time model and the proactive TTFT protection built on it (``core/step_time.py``,
``core/tiers.py``, ``Scheduler.schedule``).

Deterministic: a fake clock and fake step timings (a linear cost per step) stand in for the machine,
and the ``FakeRunner`` model proves that cut chunks, skipped steps and preemptions compute the
right KV.
"""

from __future__ import annotations

import argparse
import math

import pytest
from test_scheduler import prompt_of
from test_tiers import TierHarness, ids

from tokenmill import LLM, SamplingParams
from tokenmill.config import SchedulerConfig, TierConfig, build_engine_config
from tokenmill.core.step_io import SchedulerOutput
from tokenmill.core.step_time import CLIP_REFIT_EVERY, StepTimeModel
from tokenmill.engine_args import add_engine_args, engine_kwargs

# The fake machine: 2 ms per step, 0.5 ms per token, 1 ms per sequence.
FIXED, PER_TOKEN, PER_SEQ = 0.002, 0.0005, 0.001
TTFT = 0.1
TARGET = TTFT / 3  # the default ttft_step_fraction
LOAD_OUTPUT = 20


def step_seconds(plan: SchedulerOutput) -> float:
    return FIXED + PER_TOKEN * plan.num_tokens + PER_SEQ * len(plan.scheduled)


def slo_tiers(ttft: float | None = TTFT) -> list[TierConfig]:
    return [TierConfig("priority", ttft_slo=ttft), TierConfig("default"), TierConfig("flex")]


def loaded_harness(max_num_seqs: int = 8, **config: object) -> TierHarness:
    """A server with a 512-token budget and a backlog of long default and flex prompts."""
    config.setdefault("tiers", slo_tiers())
    h = TierHarness(
        num_blocks=2048,
        block_size=4,
        max_model_len=4096,
        budget=512,
        max_num_seqs=max_num_seqs,
        seconds_per_step=step_seconds,
        **config,
    )
    for k in range(12):
        tier = "default" if k % 2 == 0 else "flex"
        h.add(
            f"{tier}-{k}",
            prompt_of(300, 7 * k + 1),
            max_tokens=LOAD_OUTPUT,
            service_tier=tier,
            user=f"u{k % 3}",
        )
    return h


def worse_tokens(plan: SchedulerOutput) -> int:
    return sum(len(e.token_ids) for e in plan.scheduled if not e.request_id.startswith("vip"))


# ---------------------------------------------------------------- the step-time model


def test_the_model_recovers_a_linear_machine_and_answers_how_many_tokens_fit() -> None:
    model = StepTimeModel(decay=0.9, min_observations=5)
    shapes = [(8, 8), (300, 1), (40, 9), (512, 3), (1, 1), (100, 5)]
    for num_tokens, num_seqs in shapes[:4]:
        model.observe(num_tokens, num_seqs, FIXED + PER_TOKEN * num_tokens + PER_SEQ * num_seqs)
    assert model.coefficients is None and model.tokens_within(1.0, 1) is None  # too few steps yet
    for num_tokens, num_seqs in shapes[4:]:
        model.observe(num_tokens, num_seqs, FIXED + PER_TOKEN * num_tokens + PER_SEQ * num_seqs)
    assert model.coefficients == pytest.approx((FIXED, PER_TOKEN, PER_SEQ))
    assert model.predict(100, 4) == pytest.approx(FIXED + 100 * PER_TOKEN + 4 * PER_SEQ)
    # (0.0333 - 0.002 - 0.009) / 0.0005 = 44.67 tokens fit beside 9 sequences; none fit in 5 ms.
    assert model.tokens_within(TARGET, 9) == 44
    assert model.tokens_within(0.005, 9) == 0


def test_the_model_stays_non_negative_and_cautious_on_ambiguous_data() -> None:
    # Only decodes (tokens == sequences): the per-token and per-sequence costs cannot be told apart,
    # and the fit keeps the per-token term, which bounds prefill chunks.
    model = StepTimeModel()
    for n in (1, 4, 8, 16, 32, 8, 4):
        model.observe(n, n, 0.003 + 0.0015 * n)
    a, b, c = model.coefficients  # type: ignore[misc]
    assert (a, b, c) == pytest.approx((0.003, 0.0015, 0.0))
    assert model.tokens_within(0.0106, 1) == 5
    # Data that an unconstrained fit would explain with a negative cost per sequence.
    model = StepTimeModel()
    for num_tokens, num_seqs, seconds in [
        (10, 1, 0.02),
        (10, 5, 0.01),
        (50, 1, 0.06),
        (50, 5, 0.05),
        (5, 3, 0.01),
    ]:
        model.observe(num_tokens, num_seqs, seconds)
    assert min(model.coefficients) >= 0.0  # type: ignore[arg-type]
    # A machine with no measured per-token cost: bounded by twice the largest step seen.
    model = StepTimeModel(min_observations=1)
    model.observe(10, 2, 0.0)
    assert model.tokens_within(1.0, 1) == 20


def test_the_model_bounds_tokens_near_the_steps_it_has_seen() -> None:
    # Short steps of 20 or 22 tokens whose time follows their sequence count: the fit finds no
    # per-token cost, and the answer is twice the largest recent step, not "any number of tokens".
    model = StepTimeModel(decay=0.98, min_observations=5)
    shapes = [(20, 8), (22, 4), (22, 8)]
    for k in range(30):
        num_tokens, num_seqs = shapes[k % 3]
        model.observe(num_tokens, num_seqs, 0.010 + 0.002 * num_seqs)
    assert model.coefficients == pytest.approx((0.010, 0.0, 0.002))
    assert model.tokens_within(0.05, 4) == 44
    # With a per-token cost, the fit's answer, up to twice the largest recent step (which decays).
    model = StepTimeModel(decay=0.5, min_observations=5)
    for num_tokens, num_seqs in [(8, 8), (300, 1), (40, 9), (512, 3), (100, 5)]:
        model.observe(num_tokens, num_seqs, FIXED + PER_TOKEN * num_tokens + PER_SEQ * num_seqs)
    # 512 * 0.5 ** 1 = 256 after one more step: at most 512 tokens, where the fit alone allows 1,990.
    assert model.tokens_within(1.0, 1) == 512 * 2 * 0.5**1
    for _ in range(3):
        model.observe(8, 8, FIXED + PER_TOKEN * 8 + PER_SEQ * 8)
    assert model.tokens_within(1.0, 1) == 2 * 512 * 0.5**4
    assert model.tokens_within(0.0106, 1) == 15  # the fit's own bound, below the cap


def test_observing_solves_the_fit_once_in_a_while_and_predictions_see_every_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An observation is bounded by a fit at most ``CLIP_REFIT_EVERY`` observations old (solving the
    fit per step was a tenth of a decode step's Python time); ``predict`` still fits them all."""
    model = StepTimeModel(decay=0.9, min_observations=5)
    solves: list[int] = []
    solve = model._solve

    def counted() -> tuple[float, float, float] | None:
        solves.append(model.num_observations)
        return solve()

    monkeypatch.setattr(model, "_solve", counted)
    for step in range(5 + 3 * CLIP_REFIT_EVERY):
        model.observe(8, 8, FIXED + PER_TOKEN * 8 + PER_SEQ * 8 + 1e-4 * (step % 2))
    assert solves == [5, 5 + CLIP_REFIT_EVERY, 5 + 2 * CLIP_REFIT_EVERY]
    model.observe(300, 1, FIXED + PER_TOKEN * 300 + PER_SEQ)  # a shape the clip's fit has not seen
    assert model.predict(300, 1) is not None and solves[-1] == model.num_observations


def test_the_model_follows_a_machine_that_slows_down_but_not_one_freak_step() -> None:
    model = StepTimeModel(decay=0.9, min_observations=5)
    shapes = [(8, 8), (300, 1), (40, 9), (512, 3), (100, 5)]
    for num_tokens, num_seqs in shapes * 4:
        model.observe(num_tokens, num_seqs, FIXED + PER_TOKEN * num_tokens + PER_SEQ * num_seqs)
    true_seconds = FIXED + 200 * PER_TOKEN + 4 * PER_SEQ
    model.observe(8, 8, 5.0)  # a 5 s pause in a 14 ms step counts as 4 x 14 ms
    assert model.predict(200, 4) < 1.5 * true_seconds
    for num_tokens, num_seqs in shapes * 2:
        model.observe(num_tokens, num_seqs, FIXED + PER_TOKEN * num_tokens + PER_SEQ * num_seqs)
    assert model.predict(200, 4) == pytest.approx(true_seconds, rel=0.05)
    for num_tokens, num_seqs in shapes * 30:  # now everything takes twice as long
        model.observe(num_tokens, num_seqs, 2 * (FIXED + PER_TOKEN * num_tokens + PER_SEQ * num_seqs))
    assert model.predict(200, 4) == pytest.approx(2 * (FIXED + 200 * PER_TOKEN + 4 * PER_SEQ), rel=1e-3)
    with pytest.raises(ValueError, match="decay"):
        StepTimeModel(decay=0.0)


# ---------------------------------------------------------------- proactive bounding of worse tiers


def test_worse_tiers_steps_stay_within_a_third_of_the_ttft_target_and_all_finish() -> None:
    h = loaded_harness()
    times, cut = [], []
    while h.scheduler.has_unfinished():
        plan = h.step()
        times.append(step_seconds(plan))
        cut.append(any(not e.sample for e in plan.scheduled))  # a prompt chunk was cut short
    # The first steps teach the model (a full 512-token chunk takes 0.26 s); from then on every
    # step, prefill chunks and admissions included, is predicted, and takes, at most the target,
    # and a step that cut a prompt short used what the target allows.
    assert times[0] == pytest.approx(FIXED + 512 * PER_TOKEN + 2 * PER_SEQ)
    assert max(times[5:]) <= TARGET + 1e-12
    assert all(t >= TARGET - PER_TOKEN - PER_SEQ for t, c in zip(times[5:], cut[5:]) if c)
    assert sum(cut[5:]) > 20
    h.assert_all_blocks_back()
    h.assert_outputs_match_reference()
    assert all(len(out) == LOAD_OUTPUT for out in h.outputs.values())

    # Without a TTFT target the same load admits whole 300-token prompts in one step.
    h = loaded_harness(tiers=slo_tiers(ttft=None))
    times = []
    while h.scheduler.has_unfinished():
        times.append(step_seconds(h.step()))
    assert max(times[5:]) > 4 * TARGET
    h.assert_all_blocks_back()


def test_decodes_of_worse_tiers_never_stall_on_the_bound() -> None:
    # 40 running decodes alone take 62 ms, more than the 33 ms target: each still gets its token
    # every step, and prefills move on at one block (4 tokens) per step beside them.
    h = loaded_harness(max_num_seqs=40)
    for k in range(30):
        h.add(f"short-{k}", prompt_of(2, 500 + k), max_tokens=40)
    for _ in range(6):  # teach the model; admit everyone
        h.step()
    for _ in range(20):
        running_before = {r.request_id for r in h.scheduler.running if r.num_computed_tokens > 0}
        plan = h.step()
        tokens = {e.request_id: len(e.token_ids) for e in plan.scheduled}
        assert running_before <= set(tokens), "a running request of a worse tier got no token"
        extra = sum(n - 1 for rid, n in tokens.items() if rid in running_before)
        extra += sum(n for rid, n in tokens.items() if rid not in running_before)
        assert extra <= h.kv.block_size
    h.run()
    h.assert_outputs_match_reference()


# ---------------------------------------------------------------- a first token gets a step of its own


def test_a_priority_request_gets_its_first_token_in_the_first_step_after_it_arrives() -> None:
    h = loaded_harness()
    for _ in range(10):
        h.step()
    h.add("vip", prompt_of(40, 900), max_tokens=4, service_tier="priority")
    arrival = h.clock.now
    plan = h.step()
    # Worse tiers sit this step out (their 8 seats are full, so a flex request made room):
    # the prefill runs as on an idle server.
    assert ids(plan) == ["vip"] and plan.num_preempted == 1
    assert h.outputs["vip"] and h.clock.now - arrival == pytest.approx(FIXED + 40 * PER_TOKEN + PER_SEQ)
    # Worse tiers resume at once, beside the vip's decodes.
    plan = h.step()
    assert "vip" in ids(plan) and worse_tokens(plan) > 0
    h.run()
    h.assert_outputs_match_reference()

    # With exclusive steps turned off the first token shares its step with the load.
    h = loaded_harness(max_exclusive_steps=0)
    for _ in range(10):
        h.step()
    h.add("vip", prompt_of(40, 900), max_tokens=4, service_tier="priority")
    plan = h.step()
    assert ids(plan)[0] == "vip" and worse_tokens(plan) > 0
    h.run()


def test_worse_tiers_steps_take_no_longer_than_the_priority_tiers_first_token_steps() -> None:
    # Before any priority request, worse tiers fill steps up to a third of the 100 ms target. A
    # priority request's 40-token prefill then takes a step of its own of 23 ms: from then on the
    # step in flight when the next one arrives takes no longer than that, so its TTFT under load is
    # within twice its TTFT alone.
    h = loaded_harness()
    for k in range(12):  # a longer backlog: prompts keep being admitted and cut
        h.add(f"more-{k}", prompt_of(300, 300 + k), max_tokens=LOAD_OUTPUT, user=f"u{k % 3}")
    before = [step_seconds(h.step()) for _ in range(40)]
    assert max(before[5:]) > TARGET - PER_TOKEN - PER_SEQ
    h.add("vip", prompt_of(40, 900), max_tokens=2, service_tier="priority")
    own = step_seconds(h.step())
    assert own == pytest.approx(FIXED + 40 * PER_TOKEN + PER_SEQ)  # 23 ms, alone
    after = []
    while h.scheduler.has_unfinished():
        after.append(step_seconds(h.step()))
    assert max(after) <= own + 1e-12
    assert sum(t > own - PER_TOKEN - PER_SEQ for t in after) > 20  # and they use what it allows
    h.assert_all_blocks_back()
    h.assert_outputs_match_reference()


def test_a_long_priority_prompt_is_prefilled_in_steps_of_its_own_up_to_the_streak_bound() -> None:
    h = loaded_harness(max_exclusive_steps=3)
    for _ in range(10):
        h.step()
    h.add("vip", prompt_of(2000, 900), max_tokens=2, service_tier="priority")
    served_worse = [worse_tokens(h.step()) > 0 for _ in range(5)]
    # 2000 tokens at 512 per step: three steps of its own; the fourth serves everyone, and its last
    # 464 tokens and its first token come in it. Then it decodes beside the others.
    assert served_worse == [False, False, False, True, True]
    assert len(h.outputs["vip"]) == 2
    h.run()
    h.assert_outputs_match_reference()


def test_a_stream_of_priority_arrivals_cannot_starve_worse_tiers() -> None:
    h = loaded_harness(max_exclusive_steps=2)
    for _ in range(6):
        h.step()
    served_worse = []
    for k in range(30):  # a new priority request before every step
        h.add(f"vip-{k}", prompt_of(12, 1000 + 13 * k), max_tokens=1, service_tier="priority")
        plan = h.step()
        served_worse.append(worse_tokens(plan) > 0)
        assert f"vip-{k}" in ids(plan)
    # Every third step serves everyone: worse tiers keep moving, though more slowly.
    assert served_worse == [False, False, True] * 10
    h.run()
    h.assert_all_blocks_back()
    h.assert_outputs_match_reference()
    assert all(len(out) == (1 if rid.startswith("vip") else LOAD_OUTPUT) for rid, out in h.outputs.items())


def test_a_priority_request_that_cannot_start_does_not_hold_up_worse_tiers() -> None:
    # The priority tier's only seat is taken: its second request waits, and the step serves
    # everyone instead of running the first one's decode alone.
    tiers = [TierConfig("priority", ttft_slo=TTFT, max_running=1), TierConfig("default"), TierConfig("flex")]
    h = loaded_harness(tiers=tiers)
    for _ in range(6):
        h.step()
    h.add("vip-a", prompt_of(8, 900), max_tokens=5, service_tier="priority")
    h.add("vip-b", prompt_of(8, 950), max_tokens=5, service_tier="priority")
    assert ids(h.step()) == ["vip-a"]
    plan = h.step()
    assert "vip-b" not in ids(plan) and worse_tokens(plan) > 0
    h.run()
    h.assert_outputs_match_reference()


# ---------------------------------------------------------------- the engine feeds the model


def test_the_engine_times_its_steps_and_the_bound_cuts_chunks_by_them(tiny_model) -> None:  # type: ignore[no-untyped-def]
    # A TTFT target of a microsecond: once the model has five real steps, no step may hold more
    # than one token per running request plus one block (the floor that keeps prefills moving).
    model = tiny_model("llama")
    tiers = [TierConfig("priority", ttft_slo=1e-6), TierConfig("default"), TierConfig("flex")]
    llm = LLM(model.path, dtype="float32", block_size=4, num_blocks=128, tiers=tiers)
    scheduler = llm.engine.scheduler
    shapes: list[tuple[int, int]] = []  # (running before the step, tokens planned)
    schedule = scheduler.schedule

    def recording() -> SchedulerOutput:
        running = scheduler.num_running
        plan = schedule()
        shapes.append((running, plan.num_tokens))
        return plan

    scheduler.schedule = recording  # type: ignore[method-assign]
    prompts = [[(7 * k + 3 * i) % 150 + 5 for i in range(n)] for k, n in enumerate((30, 22, 14))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [model.greedy(p, 6) for p in prompts]
    # Every step but the first (which pays one-time costs) was timed.
    assert scheduler.step_time.num_observations == sum(1 for _, tokens in shapes if tokens) - 1
    assert scheduler.step_time.coefficients is not None
    assert shapes[0][1] == 66  # before any step was timed, nothing is cut
    assert all(tokens <= running + 4 for running, tokens in shapes[5:])


# ---------------------------------------------------------------- configuration


def test_the_new_scheduler_options_are_validated_and_parsed() -> None:
    for field, value, message in [
        ("ttft_step_fraction", 0.0, "ttft_step_fraction must be in"),
        ("ttft_step_fraction", 1.5, "ttft_step_fraction must be in"),
        ("max_exclusive_steps", -1, "max_exclusive_steps must be >= 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            SchedulerConfig(**{field: value}).validate()  # type: ignore[arg-type]
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        ["--tier-slo", "priority:ttft=0.1", "--ttft-step-fraction", "0.25", "--max-exclusive-steps", "2"]
    )
    scheduler = build_engine_config("m", **engine_kwargs(args)).scheduler
    assert (scheduler.ttft_step_fraction, scheduler.max_exclusive_steps) == (0.25, 2)
    defaults = build_engine_config("m", **engine_kwargs(parser.parse_args([]))).scheduler
    assert math.isclose(defaults.ttft_step_fraction, 1 / 3) and defaults.max_exclusive_steps == 4
