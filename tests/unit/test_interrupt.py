"""Step interrupts (``step_control.py``): a TTFT tier's arrival abandons the step in flight.

Scheduler-level with the fake model of ``test_scheduler`` (which plans may be cut, and that an
abandoned plan changes nothing), then through the real engine on tiny models, fused decode stack and
layer modules alike: steps cut between layers are redone, and steps paused for short prefills go on,
with the same tokens; the fused stack stops before a layer and goes on from there bit for bit.
(Pauses themselves: ``test_paused_steps.py``.)
"""

from __future__ import annotations

import pytest
import torch
from test_scheduler import prompt_of
from test_tiers import TierHarness, ids

from tokenmill import LLM, SamplingParams
from tokenmill.config import TierConfig
from tokenmill.core.engine_core import MAX_PAUSES_PER_STEP
from tokenmill.layers import fused_cpu
from tokenmill.layers.forward_batch import LayerProgress
from tokenmill.step_control import InterruptFlag


def slo_tiers() -> list[TierConfig]:
    return [TierConfig("priority", ttft_slo=0.1), TierConfig("default"), TierConfig("flex")]


def test_only_plans_without_a_protected_first_token_may_be_cut_and_never_two_in_a_row() -> None:
    h = TierHarness(budget=16, tiers=slo_tiers())
    for k in range(3):
        h.add(f"load-{k}", prompt_of(20, 10 * k + 1), max_tokens=6)
    plan = h.scheduler.schedule()
    assert plan.interruptible
    h.scheduler.step_interrupted(plan)  # abandoned: nothing computed, nothing counted
    again = h.scheduler.schedule()
    # The same tokens are planned again, and this plan may not be cut.
    assert [(e.request_id, e.token_ids) for e in again.scheduled] == [
        (e.request_id, e.token_ids) for e in plan.scheduled
    ]
    assert not again.interruptible
    h.scheduler.step_interrupted(again)
    h.add("vip", prompt_of(8, 500), max_tokens=3, service_tier="priority")
    plan = h.step()  # the protected first token: not interruptible, served on its own
    assert ids(plan) == ["vip"] and not plan.interruptible and plan.first_token_exclusive
    while h.scheduler.has_unfinished():
        plan = h.scheduler.schedule()
        if plan.interruptible:
            h.scheduler.step_interrupted(plan)  # cut every step that may be cut
            continue
        h.finish_step(plan)
    h.assert_all_blocks_back()
    h.assert_outputs_match_reference()

    # Without a TTFT target no step is ever cut.
    h = TierHarness(budget=16)
    h.add("load", prompt_of(20, 1), max_tokens=2)
    assert not h.scheduler.schedule().interruptible


def test_a_step_whose_blocks_another_request_shares_is_never_cut() -> None:
    # A redo could plan the sharer without the chunk that writes the blocks it reads.
    shared = prompt_of(12, 100)
    for same_prefix in (True, False):
        h = TierHarness(budget=64, tiers=slo_tiers(), prefix_caching=True)
        h.add("first", shared + [1], max_tokens=2)
        h.add("second", (shared if same_prefix else prompt_of(12, 300)) + [2], max_tokens=2)
        plan = h.scheduler.schedule()
        starts = {e.request_id: e.start_position for e in plan.scheduled}
        assert starts == {"first": 0, "second": 12 if same_prefix else 0}
        assert plan.interruptible is not same_prefix
        h.finish_step(plan)
        while h.scheduler.has_unfinished():
            h.finish_step(h.scheduler.schedule())
        h.assert_all_blocks_back()
        h.assert_outputs_match_reference()

    # The same for n > 1 siblings, which share the first sample's prompt blocks.
    h = TierHarness(budget=64, tiers=slo_tiers())
    for i in range(2):
        h.add(f"g-{i}", shared + [3], max_tokens=2, group_id="g", sibling_index=i)
    plan = h.scheduler.schedule()
    assert {e.request_id: e.start_position for e in plan.scheduled} == {"g-0": 0, "g-1": 12}
    assert not plan.interruptible


@pytest.mark.parametrize("quantization", ["int4", None])  # the fused decode stack; the layer modules
@pytest.mark.parametrize("rule", ["ttft tier", "short prefill"])
def test_cut_steps_are_redone_and_paused_ones_go_on_with_the_same_tokens(
    quantization: str | None,
    rule: str,
    tiny_model,  # type: ignore[no-untyped-def]
    tmp_path,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompts = [[7 + (3 * i + k) % 50 for i in range(n)] for k, n in enumerate((9, 30, 4))]
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=10, ignore_eos=True, logprobs=2)

    def run(interrupt: bool) -> tuple[list[tuple[list[int], object]], LLM]:
        llm = LLM(
            tiny_model("llama").path,
            dtype="bfloat16",
            quantization=quantization,
            num_blocks=64,
            enable_prefix_caching=False,
            **({"tiers": slo_tiers()} if rule == "ttft tier" else {"short_prefill_interrupt": 8}),
        )
        core = llm.engine
        if interrupt:
            flag = InterruptFlag.create(str(tmp_path))
            core.set_interrupt(flag)
            step = core.step

            def raised_before_every_step():  # type: ignore[no-untyped-def]
                flag.raise_()  # as if a priority request had just been sent
                try:
                    return step()
                finally:
                    flag.clear()  # the engine loop clears it before reading its input

            monkeypatch.setattr(core, "step", raised_before_every_step)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results = [
            (list(o.outputs[0].token_ids), [sorted(row.items()) for row in o.outputs[0].logprobs or []])
            for o in outputs
        ]
        return results, llm

    reference, _ = run(interrupt=False)
    stack_calls: list[int] = []
    original = fused_cpu.llama_decode_stack

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        stack_calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(fused_cpu, "llama_decode_stack", counting)
    cut, llm = run(interrupt=True)
    assert cut == reference
    core = llm.engine
    if rule == "ttft tier":
        # Every other step that may be cut was (never two in a row).
        assert core.num_interrupted_steps >= 10 and core.num_paused_steps == 0
    else:
        # Short prefills pause steps (before the first layer here), never abandon them; a step pauses
        # at most MAX_PAUSES_PER_STEP times, then runs to the end.
        assert core.num_interrupted_steps == 0 and core.num_paused_steps >= 3 * MAX_PAUSES_PER_STEP
    # The blocks all came back.
    assert core.kv_manager.pool.num_free == core.kv_manager.num_blocks
    assert bool(stack_calls) == (quantization == "int4")


def test_the_fused_stack_stops_before_a_layer_when_the_flag_is_raised_and_goes_on_from_there(
    tiny_model,
) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(tiny_model("x-four-layers").path, dtype="bfloat16", quantization="int4", num_blocks=16)
    recorded: list[tuple[tuple[object, ...], torch.Tensor]] = []
    original = fused_cpu.llama_decode_stack

    def recording(hidden: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        hidden_in = hidden.clone()
        out = original(hidden, *args, **kwargs)
        recorded.append(((hidden_in, *args), out.clone()))
        return out

    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused_cpu, "llama_decode_stack", recording)
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    (hidden, *args), out = recorded[-1]
    *args, _ = args  # the interrupt, passed below
    raised, lowered = torch.ones(1, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
    assert torch.equal(original(hidden.clone(), *args, lowered), out)
    # A raised flag makes the call return where it stopped (layers never raise to stop a step).
    progress = original(hidden.clone(), *args, raised)
    assert isinstance(progress, LayerProgress) and progress.next_layer == 0 and progress.residual is None
    # A resumed call runs one layer before it reads the flag again; from where it stops, the rest of
    # the stack gives the same bits as one call.
    for layer in (1, 2):
        progress = original(hidden, *args, raised, resume_from=progress)
        assert isinstance(progress, LayerProgress)
        assert progress.next_layer == layer and progress.residual is not None
    assert torch.equal(original(hidden, *args, lowered, resume_from=progress), out)
    with pytest.raises(RuntimeError, match="takes the residual stream"):
        original(hidden, *args, lowered, resume_from=LayerProgress(2, progress.hidden, None))
    with pytest.raises(RuntimeError, match="interrupt must be a uint8 CPU tensor"):
        original(hidden.clone(), *args, torch.ones(1))
