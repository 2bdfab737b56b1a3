"""How many waiting requests a step admits (``core/admission.py``, ``step_admission_cap``).

Deterministic: the harness's fake machine (4 ms a step, 1 ms a token, 2 ms a sequence) teaches the
scheduler's step-time model, and the ``FakeRunner`` model proves every output right.
"""

from __future__ import annotations

import argparse
import math

import pytest
from test_scheduler import Harness, ids, prompt_of, reference

from tokenmill.config import SchedulerConfig, build_engine_config
from tokenmill.core.admission import ttft_admission_cap
from tokenmill.core.step_io import SchedulerOutput
from tokenmill.core.step_time import StepTimeModel
from tokenmill.engine_args import add_engine_args, engine_kwargs

FIXED, PER_TOKEN, PER_SEQ = 0.004, 0.001, 0.002  # the harness's fake machine
# Prompt lengths of the decoding requests: uneven, so the steps' token and sequence counts vary apart.
DECODER_PROMPTS = [20, 3, 11, 30, 6, 17, 9, 25]


def step_seconds(plan: SchedulerOutput) -> float:
    return FIXED + PER_TOKEN * plan.num_tokens + PER_SEQ * len(plan.scheduled)


def linear_model() -> StepTimeModel:
    model = StepTimeModel()
    for num_tokens, num_seqs in [(64, 8), (8, 8), (300, 1), (40, 9), (100, 5)]:
        model.observe(num_tokens, num_seqs, FIXED + PER_TOKEN * num_tokens + PER_SEQ * num_seqs)
    return model


def test_the_cap_is_the_batch_size_that_keeps_the_mean_wait_least() -> None:
    model = linear_model()
    # Eight decodes cost o = 4 + 8 + 16 = 28 ms; a 30-token prompt p = 30 + 2 = 32 ms more.
    # Twelve waiting: sqrt(28 * 12 / 32) = 3.24 -> 3 a step.
    assert ttft_admission_cap(model, 8, 8, 12, 30.0) == 3
    # Long prompts next to cheap decodes: one a step (sqrt(28 * 4 / 302) = 0.61, never below 1).
    assert ttft_admission_cap(model, 8, 8, 4, 300.0) == 1
    # Cheap prompts: sqrt(28 * 5 / 3) = 6.8, but only five wait.
    assert ttft_admission_cap(model, 8, 8, 5, 1.0) == 5
    # Nothing waits, or the model cannot predict yet: no cap.
    assert ttft_admission_cap(model, 8, 8, 0, 30.0) is None
    assert ttft_admission_cap(StepTimeModel(), 8, 8, 12, 30.0) is None


def burst_harness(admission: str) -> tuple[Harness, list[str]]:
    """Eight decoding requests (admitted one a step, so the step-time model sees varied steps),
    then a burst of twelve 30-token prompts arriving together. Returns the harness and the burst."""
    h = Harness(num_blocks=512, block_size=4, budget=512, max_num_seqs=64, admission=admission)
    for k, length in enumerate(DECODER_PROMPTS):
        h.add(f"d{k}", prompt_of(length, 100 * k + 1), max_tokens=40)
        h.step()
    burst = [f"b{k}" for k in range(12)]
    for k, request_id in enumerate(burst):
        h.add(request_id, prompt_of(30, 1000 + 50 * k), max_tokens=3)
    return h, burst


def run_burst(admission: str) -> tuple[Harness, list[SchedulerOutput], dict[str, float]]:
    """Run the burst to the end on the fake machine's clock; returns the harness, the plans from the
    burst's arrival on, and each burst request's time to its first token."""
    h, burst = burst_harness(admission)
    now, first_token, plans = 0.0, {}, []
    while h.scheduler.has_unfinished():
        plan, outputs = h.step()
        plans.append(plan)
        now += step_seconds(plan)
        for output in outputs:
            if output.request_id in burst and output.new_token_ids:
                first_token.setdefault(output.request_id, now)
    return h, plans, first_token


def test_ttft_admission_spreads_a_burst_and_lowers_its_mean_time_to_first_token() -> None:
    h, plans, ttft = run_burst("ttft")
    assert h.scheduler.step_time.coefficients == pytest.approx((FIXED, PER_TOKEN, PER_SEQ))
    # 3 of the 12 in the first step (the cap of the test above), which ends after 124 ms; the rest later.
    assert [i for i in ids(plans[0]) if i.startswith("b")] == ["b0", "b1", "b2"]
    assert sorted(ttft.values())[:4] == pytest.approx([0.124] * 3 + [0.257])
    fill_h, fill_plans, fill_ttft = run_burst("fill")
    assert len([i for i in ids(fill_plans[0]) if i.startswith("b")]) == 12  # all the budget holds
    # One 412 ms step for all twelve, against batches of three: a mean of 0.33 s against 0.41 s.
    assert math.isclose(max(fill_ttft.values()), min(fill_ttft.values()))
    mean = sum(ttft.values()) / len(ttft)
    fill_mean = sum(fill_ttft.values()) / len(fill_ttft)
    assert mean < 0.85 * fill_mean, (mean, fill_mean)
    for harness in (h, fill_h):
        for k in range(12):
            assert harness.outputs[f"b{k}"] == reference(prompt_of(30, 1000 + 50 * k), 3)
        for k, length in enumerate(DECODER_PROMPTS):
            assert harness.outputs[f"d{k}"] == reference(prompt_of(length, 100 * k + 1), 40)
        harness.assert_all_blocks_back()


def test_fill_is_the_python_default_and_ttft_the_command_lines() -> None:
    assert SchedulerConfig().admission == "fill"
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert build_engine_config("m", **engine_kwargs(parser.parse_args([]))).scheduler.admission == "ttft"
    args = parser.parse_args(["--admission", "fill"])
    assert build_engine_config("m", **engine_kwargs(args)).scheduler.admission == "fill"
    with pytest.raises(ValueError, match=r"admission must be one of \['fill', 'ttft'\], got 'sjf'"):
        SchedulerConfig(admission="sjf").validate()
