"""The measured drafting gate (core/spec_payoff.py) and its use by the scheduler's speculative state:
a batch-size class whose drafted decode steps yield fewer tokens per second than its plain ones stops
drafting, re-measuring one step in every ``explore_every``; prompt steps are not measured."""

from __future__ import annotations

import dataclasses

import pytest

from tokenmill.config import SpeculativeConfig
from tokenmill.core.request import Request
from tokenmill.core.spec_decode import SpecDecodeState
from tokenmill.core.spec_payoff import DraftPayoff
from tokenmill.core.step_io import ScheduledRequest, SchedulerOutput
from tokenmill.core.step_time import StepTimeModel
from tokenmill.protocol import EngineCoreRequest
from tokenmill.sampling_params import SamplingParams


def measured(drafted_rate: float, plain_rate: float, num_seqs: int = 1, **kwargs: int) -> DraftPayoff:
    """A gate with ``min_samples`` steps of each side at these tokens per second (``num_seqs`` class)."""
    payoff = DraftPayoff(**kwargs)
    for _ in range(payoff.min_samples):
        payoff.observe(num_seqs, round(drafted_rate), drafted=True, seconds=1.0, proposed=True)
        payoff.observe(num_seqs, round(plain_rate), drafted=False, seconds=1.0, proposed=False)
    return payoff


def test_runs_alternate_until_both_sides_are_measured_and_mixed_steps_are_not() -> None:
    """A step verifies what the step before it proposed: the first step of a run carries one side's
    tokens and the other's cost, and is not measured; runs alternate until each side has
    ``min_samples`` measured steps."""
    payoff = DraftPayoff(min_samples=2, run_length=3)
    decisions, verifying = [], True
    for _ in range(7):
        proposing = payoff.should_draft(3)
        decisions.append(proposing)
        # Verifying steps emit two tokens an entry in 10 ms; plain ones one; a step that proposes
        # pays 20 ms more.
        seconds = 0.010 + 0.020 * proposing
        payoff.observe(3, 6 if verifying else 3, drafted=verifying, seconds=seconds, proposed=proposing)
        verifying = proposing
    assert decisions == [True] * 3 + [False] * 3 + [False]
    # Measured: verifying and proposing 6 / 0.030 = 200 tokens/s, plain 3 / 0.010 = 300; the mixed
    # steps (3 / 0.010 verifying without proposing: 600; 3 / 0.030 the other way) are not.
    assert payoff.rates() == {2: (pytest.approx(200.0), pytest.approx(300.0))}


def test_a_losing_side_is_taken_only_to_re_measure_it_ever_less_often_while_it_keeps_losing() -> None:
    payoff = measured(drafted_rate=50, plain_rate=100, explore_every=8, max_explore_every=32)
    decisions = [payoff.should_draft(1) for _ in range(64)]
    # Runs of 3 from the 8th decision; each that leaves the verdict standing doubles the interval.
    explored = [i for i, drafted in enumerate(decisions) if drafted]
    assert explored == [7, 8, 9, 23, 24, 25, 55, 56, 57]
    assert payoff.rates() == {1: (50.0, 100.0)}
    winning = measured(drafted_rate=150, plain_rate=100, explore_every=8)
    assert [winning.should_draft(1) for _ in range(11)] == [True] * 7 + [False] * 3 + [True]


def test_an_exploring_run_that_changes_the_verdict_resets_the_interval() -> None:
    payoff = measured(drafted_rate=50, plain_rate=100, explore_every=8, smoothing=1.0)
    decisions = [payoff.should_draft(1) for _ in range(10)]
    assert [i for i, d in enumerate(decisions) if d] == [7, 8, 9]
    # Its steps measured drafting faster now (copying began): drafting wins and the next exploring
    # run (of plain steps) comes after the base interval again, not a doubled one.
    payoff.observe(1, 300, drafted=True, seconds=1.0, proposed=True)
    decisions = [payoff.should_draft(1) for _ in range(8)]
    assert decisions == [True] * 5 + [False] * 3  # decisions 10..14 draft, 15..17 explore plain


def test_a_verdict_standing_by_a_narrow_margin_or_borrowed_keeps_the_base_interval() -> None:
    narrow = measured(drafted_rate=90, plain_rate=100, explore_every=8)  # 1.11 < decisive_margin
    decisions = [narrow.should_draft(1) for _ in range(26)]
    assert [i for i, d in enumerate(decisions) if d] == [7, 8, 9, 15, 16, 17, 23, 24, 25]
    borrowed = measured(drafted_rate=50, plain_rate=100, num_seqs=1, explore_every=8)
    decisions = [borrowed.should_draft(16) for _ in range(26)]  # plain borrowed from one sequence
    assert [i for i, d in enumerate(decisions) if d] == [7, 8, 9, 15, 16, 17, 23, 24, 25]


def test_a_class_borrows_plain_from_a_smaller_class_and_drafted_from_a_larger_one() -> None:
    """Drafting pays less the larger the batch: plain winning at one sequence holds at 16, drafted
    winning at 16 holds at one; the other way round only a wide margin carries, ``decisive_margin``
    (1.3) per class between."""
    losing_small = measured(drafted_rate=95, plain_rate=100, num_seqs=1, explore_every=8)
    assert losing_small.verdict(16) is False
    assert [losing_small.should_draft(16) for _ in range(8)] == [False] * 7 + [True]  # explores at the 8th
    winning_large = measured(drafted_rate=105, plain_rate=100, num_seqs=16)
    assert winning_large.verdict(1) is True and winning_large.should_draft(1)
    losing_large = measured(drafted_rate=80, plain_rate=100, num_seqs=16)  # 1.25 < 1.3: nothing below
    assert losing_large.verdict(8) is None
    assert [losing_large.should_draft(8) for _ in range(3)] == [True] * 3  # measuring its drafted side first
    winning_small = measured(drafted_rate=120, plain_rate=100, num_seqs=1)
    assert winning_small.verdict(2) is None
    # Drafted steps at 16 yielding 0.6x what plain ones do: plain for 8-15 (1.67 >= 1.3), not for 4-7
    # (1.67 < 1.69); drafted at one sequence winning 2x: drafted for 2-3 and 4-7 (2 >= 1.69), not 8-15.
    falling = measured(drafted_rate=60, plain_rate=100, num_seqs=16)
    assert [falling.verdict(n) for n in (8, 15, 4, 7)] == [False, False, None, None]
    rising = measured(drafted_rate=200, plain_rate=100, num_seqs=1)
    assert [rising.verdict(n) for n in (2, 3, 4, 7, 8)] == [True, True, True, True, None]
    # The nearest class with a verdict speaks: drafted winning at 2-3 sequences outweighs plain at 1.
    mixed = measured(drafted_rate=80, plain_rate=100, num_seqs=1)
    for _ in range(mixed.min_samples):
        mixed.observe(2, 200, drafted=True, seconds=1.0, proposed=True)
        mixed.observe(2, 100, drafted=False, seconds=1.0, proposed=False)
    assert mixed.verdict(2) is True and mixed.verdict(4) is True and mixed.verdict(16) is None


def test_one_run_a_side_decides_when_one_side_wins_clearly() -> None:
    """After a run of each side (``run_length - 1`` measured steps each), a side ahead by
    ``decisive_margin`` decides; a closer race keeps alternating up to ``min_samples``."""

    def after_one_run_each(drafted_rate: int, plain_rate: int) -> DraftPayoff:
        payoff = DraftPayoff(min_samples=4, run_length=3, decisive_margin=1.3)
        for _ in range(2):
            payoff.observe(16, drafted_rate, drafted=True, seconds=1.0, proposed=True)
            payoff.observe(16, plain_rate, drafted=False, seconds=1.0, proposed=False)
        return payoff

    clear = after_one_run_each(drafted_rate=70, plain_rate=100)
    assert clear.verdict(16) is False
    assert [clear.should_draft(16) for _ in range(10)] == [False] * 10
    close = after_one_run_each(drafted_rate=90, plain_rate=100)
    assert close.verdict(16) is None
    assert [close.should_draft(16) for _ in range(3)] == [True] * 3  # alternating on


def test_classes_are_measured_apart_and_a_change_is_followed() -> None:
    payoff = measured(drafted_rate=50, plain_rate=100, num_seqs=16)
    assert payoff.should_draft(1)  # the single-stream class has seen nothing: it explores
    assert not payoff.should_draft(20)  # 16..31 share a class
    for _ in range(10):  # drafting became worth it (say, copying began)
        payoff.observe(17, 300, drafted=True, seconds=1.0, proposed=True)
    assert payoff.should_draft(16)


def test_a_model_drafter_re_measures_a_class_after_an_interval_times_its_smallest_batch() -> None:
    """With ``batch_scaled_exploring`` (a drafter that catches up over skipped positions when it
    drafts again) plain winning at 16-31 sequences is re-measured after 16 times the interval; one
    sequence keeps the base intervals, doubling as before; 4-7 sequences wait 4 times as long."""
    large = measured(
        drafted_rate=50, plain_rate=100, num_seqs=16, explore_every=8, batch_scaled_exploring=True
    )
    decisions = [large.should_draft(20) for _ in range(8 * 16 + 3)]
    assert [i for i, d in enumerate(decisions) if d] == [127, 128, 129]
    single = measured(
        drafted_rate=50, plain_rate=100, explore_every=8, max_explore_every=32, batch_scaled_exploring=True
    )
    decisions = [single.should_draft(1) for _ in range(64)]
    assert [i for i, d in enumerate(decisions) if d] == [7, 8, 9, 23, 24, 25, 55, 56, 57]
    borrowed = measured(drafted_rate=50, plain_rate=100, explore_every=8, batch_scaled_exploring=True)
    decisions = [borrowed.should_draft(5) for _ in range(8 * 4 + 3)]  # plain borrowed from one sequence
    assert [i for i, d in enumerate(decisions) if d] == [31, 32, 33]


def test_the_scheduler_state_scales_exploring_for_model_drafters_only() -> None:
    def scaled(method: str, model: str | None) -> bool:
        config = SpeculativeConfig(method=method, model=model, num_speculative_tokens=4)
        return SpecDecodeState(config, StepTimeModel()).payoff.batch_scaled_exploring

    assert not scaled("ngram", None)
    assert scaled("eagle", "/a/head") and scaled("eagle3", "/a/head") and scaled("draft_model", "/a/model")


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="explore_every >= 2"):
        DraftPayoff(explore_every=1)
    with pytest.raises(ValueError, match="2 <= run_length < explore_every"):
        DraftPayoff(run_length=1)
    with pytest.raises(ValueError, match="decisive_margin >= 1"):
        DraftPayoff(decisive_margin=0.9)
    with pytest.raises(ValueError, match="max_explore_every >= explore_every"):
        DraftPayoff(explore_every=64, max_explore_every=32)


def entry(prompt_len: int, start: int, drafts: list[int]) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=f"r{start}",
        token_ids=[5] * (1 + len(drafts)),
        start_position=start,
        block_table=[0, 1, 2, 3],
        sample=True,
        sampling_params=SamplingParams(),
        prompt_token_ids=[5] * prompt_len,
        output_token_ids=[5] * (start - prompt_len + 1),
        forbidden_token_ids=[],
        prompt_logprobs_range=None,
        seed=None,
        draft_token_ids=drafts,
    )


def test_the_scheduler_state_drafts_only_where_drafting_measured_faster() -> None:
    """The gate decides a step ahead (``propose_next``, the plan's ``propose_drafts``): the runner
    drafts only for a step that will verify drafts. Once drafted steps measure slower, the state
    neither plans drafts nor asks for them (up to the next exploring step)."""
    state = SpecDecodeState(SpeculativeConfig(num_speculative_tokens=4), StepTimeModel())
    core_request = EngineCoreRequest(
        request_id="r", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=32)
    )
    request = Request(core_request, max_model_len=64)
    request.num_computed_tokens = 2
    drafted_plan = SchedulerOutput(scheduled=[entry(3, 4, [9, 9, 9])])
    plain_plan = SchedulerOutput(scheduled=[entry(3, 5, [])])
    prompt_plan = SchedulerOutput(scheduled=[entry(8, 4, [])])  # a prompt's last token: not measured

    def step() -> tuple[int, bool]:
        """One step: drafts exist when the previous plan asked for them; drafted steps take 30 ms
        for one token (~33 tokens/s), plain ones 10 ms (100 tokens/s)."""
        request.draft_token_ids = [4, 5, 6, 7] if state.propose_next else []
        state.begin_step(num_running=1)
        planned = state.num_drafts_to_plan(request)
        plan = dataclasses.replace(drafted_plan if planned else plain_plan, propose_drafts=state.propose_next)
        state.observe_step(plan, 0.030 if planned else 0.010)
        state.observe_step(prompt_plan, 1.0)
        return planned, state.propose_next

    first = [step() for _ in range(16)]
    assert {planned for planned, _ in first} == {0, 4}
    assert state.payoff.rates() == {1: (pytest.approx(1 / 0.030), pytest.approx(100.0))}
    assert [step() for _ in range(8)] == [(0, False)] * 8
    fixed = SpecDecodeState(SpeculativeConfig(num_speculative_tokens=4, adaptive=False), StepTimeModel())
    request.draft_token_ids = [4, 5, 6, 7]
    fixed.begin_step(num_running=1)
    assert fixed.num_drafts_to_plan(request) == 4 and fixed.propose_next  # adaptive off: no gate


def test_a_verifying_step_that_verifies_no_draft_is_measured_on_neither_side() -> None:
    """An n-gram miss: the step was to verify drafts, but the proposer found none. It costs what a plain
    step costs; counted on the drafted side, a stretch of text that is not copied would stop drafting
    before the copying starts. Only steps that verify at least one draft measure the drafted side."""
    state = SpecDecodeState(SpeculativeConfig(num_speculative_tokens=4), StepTimeModel())
    missed = SchedulerOutput(scheduled=[entry(3, 5, [])], propose_drafts=True)
    drafted = SchedulerOutput(scheduled=[entry(3, 4, [9, 9])], propose_drafts=True)
    for _ in range(3):  # the first run of decisions verifies (both sides unmeasured: drafting first)
        state.begin_step(num_running=1)
        state.observe_step(missed, 0.010)
    assert state.payoff.rates() == {} and state.payoff._class(1).drafted.count == 0
    state.begin_step(num_running=1)
    state.observe_step(drafted, 0.010)
    assert state.payoff._class(1).drafted.count == 1
    assert state.payoff._class(1).drafted.tokens_per_second == pytest.approx(100.0)


def test_a_drafter_that_ran_and_cut_every_draft_is_measured_on_the_drafted_side() -> None:
    """An EAGLE head below ``draft_confidence`` on every entry: no draft to verify, but the head's pass
    was paid for (a chat single stream: three steps in four), so the step counts for drafting."""
    state = SpecDecodeState(SpeculativeConfig(method="eagle", model="head"), StepTimeModel())
    missed = SchedulerOutput(scheduled=[entry(3, 5, [])], propose_drafts=True)
    for _ in range(3):  # the first run of decisions verifies (both sides unmeasured: drafting first)
        state.begin_step(num_running=1)
        state.observe_step(missed, 0.020)
    assert state.payoff._class(1).drafted.count == 3
    assert state.payoff._class(1).drafted.tokens_per_second == pytest.approx(50.0)
