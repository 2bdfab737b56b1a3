"""Plans as deltas (``executor/plan_delta.py``): what the scheduler plans, encoded on the engine side,
sent as msgpack bytes and decoded by a worker that keeps per-request state, is the same plan.

Real scheduler plan sequences (chunked prefill, preemption, n > 1 siblings sharing blocks, sliding
window releases, seeded sampling with min_tokens and prompt logprobs) run through the fake model of
``test_scheduler`` with every plan round-tripped first; then the cases the scheduler rarely makes
(jump-forward's several tokens, an id reused by a new request, a grammar bitmask) by hand.
"""

from __future__ import annotations

import msgspec
import torch
from test_scheduler import MAX_MODEL_LEN, FakeRunner, Harness, prompt_of, reference
from test_sliding_window_kv import windowed_harness, windowed_reference

from tokenmill.core.kv.manager import RELEASED_BLOCK
from tokenmill.core.request import Request
from tokenmill.core.step_io import (
    GrammarBitmask,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    StepStatus,
)
from tokenmill.executor.plan_delta import PlanDecoder, PlanEncoder, output_from_wire, output_to_wire
from tokenmill.protocol import EngineCoreRequest, PositionLogprobs, StepDone, StepPlanData
from tokenmill.sampling_params import SamplingParams


class RoundTripRunner:
    """Sends every plan through encoder → msgpack → decoder, checks the rebuilt plan equals the
    original, then runs the original on ``inner``. Counts the requests sent in full."""

    def __init__(self, inner: FakeRunner) -> None:
        self.inner = inner
        self.encoder = PlanEncoder()
        self.decoder = PlanDecoder()
        self.num_sent_in_full = 0
        self.num_deltas = 0
        self.num_changed_tables = 0  # deltas that changed entries of a table (not only appended)

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        wire = msgspec.msgpack.encode(self.encoder.encode(plan))
        data = msgspec.msgpack.decode(wire, type=StepPlanData)
        self.num_sent_in_full += len(data.new_requests)
        self.num_deltas += len(data.scheduled) - len(data.new_requests)
        self.num_changed_tables += sum(1 for delta in data.scheduled if delta.changed_blocks)
        assert_same_plan(self.decoder.decode(data), plan)
        return self.inner.execute(plan)


def assert_same_plan(rebuilt: SchedulerOutput, plan: SchedulerOutput) -> None:
    assert rebuilt.scheduled == plan.scheduled
    for name in (
        "finished_request_ids",
        "num_preempted",
        "first_token_exclusive",
        "interruptible",
        "pausable",
        "propose_drafts",
    ):
        assert getattr(rebuilt, name) == getattr(plan, name), name
    assert rebuilt.shared_sources == plan.shared_sources


def round_trip(h: Harness) -> RoundTripRunner:
    runner = RoundTripRunner(h.runner)
    h.runner = runner  # type: ignore[assignment]
    return runner


def test_chunked_prefill_and_preemption_round_trip_as_deltas() -> None:
    h = Harness(num_blocks=8, budget=5)
    runner = round_trip(h)
    prompts = [prompt_of(7, 10 * k) for k in range(4)]
    for k, prompt in enumerate(prompts):
        h.add(str(k), prompt, max_tokens=20)
    h.run()
    assert h.scheduler.num_preemptions_total > 0
    assert all(h.outputs[str(k)] == reference(p, 20) for k, p in enumerate(prompts))
    # Each request once, and again after a preemption (it restarts with a shorter table).
    assert 4 < runner.num_sent_in_full <= 4 + h.scheduler.num_preemptions_total
    assert runner.num_deltas > 4 * 20  # everything else is a delta
    # The last request's end goes out with the next plan (the engine runs empty ones too); then the
    # worker holds nothing.
    runner.execute(h.scheduler.schedule())
    assert runner.decoder.requests == {} and runner.encoder._sent == {}
    h.assert_all_blocks_back()


def test_siblings_sharing_blocks_under_the_prefix_cache_round_trip() -> None:
    h = Harness(num_blocks=32, prefix_caching=True, budget=16)
    runner = round_trip(h)
    prompt = prompt_of(10)
    for i in range(3):
        h.add(f"g-{i}", prompt, max_tokens=6, group_id="g", sibling_index=i)
    h.add("later", prompt + [7, 8, 9], max_tokens=4)
    h.run()
    assert all(h.outputs[f"g-{i}"] == reference(prompt, 6) for i in range(3))
    # The siblings' copies of their last prompt block are swapped for the first one's: a delta.
    assert runner.num_sent_in_full == 4 and runner.num_changed_tables > 0


def test_sliding_window_releases_round_trip_as_a_growing_released_prefix() -> None:
    h = windowed_harness(num_blocks=40, prefix_caching=False, budget=5)
    runner = round_trip(h)
    prompts = {f"r{i}": [3 + (7 * i + j) % 50 for j in range(n)] for i, n in enumerate((2, 13, 25, 7))}
    for request_id, prompt in prompts.items():
        h.add(request_id, prompt, max_tokens=30)
    released: list[int] = []
    while h.scheduler.has_unfinished():
        plan, _ = h.step()
        released += [e.block_table.count(RELEASED_BLOCK) for e in plan.scheduled]
    assert max(released) > 2  # the windows released blocks while the requests ran
    assert runner.num_sent_in_full == len(prompts)  # releases are changed entries
    for request_id, prompt in prompts.items():
        assert h.outputs[request_id] == windowed_reference(prompt, 30), request_id


def test_seeded_sampling_with_min_tokens_and_prompt_logprobs_round_trips() -> None:
    h = Harness(num_blocks=32, budget=6)
    runner = round_trip(h)
    params = SamplingParams(
        temperature=0.8, seed=11, min_tokens=3, max_tokens=5, prompt_logprobs=1, logprobs=2
    )
    for i in range(2):
        core = EngineCoreRequest(
            request_id=f"s-{i}",
            prompt_token_ids=prompt_of(9, 40),
            sampling_params=params,
            eos_token_ids=[2, 10 + i],
            group_id="s",
            sibling_index=i,
        )
        h.scheduler.add_request(Request(core, MAX_MODEL_LEN))
        h.outputs[f"s-{i}"] = []
    plans = []
    while h.scheduler.has_unfinished():
        plans.append(h.step()[0])
    entries = [e for plan in plans for e in plan.scheduled]
    assert {e.seed for e in entries} == {11, 12}
    assert any(e.forbidden_token_ids for e in entries) and any(e.prompt_logprobs_range for e in entries)
    assert runner.num_sent_in_full == 2


def entry(
    request_id: str, prompt: list[int], outputs: list[int], table: list[int], start: int, n: int
) -> ScheduledRequest:
    tokens = (prompt + outputs)[start : start + n]
    return ScheduledRequest(
        request_id=request_id,
        token_ids=tokens,
        start_position=start,
        block_table=table,
        sample=True,
        sampling_params=PARAMS,
        prompt_token_ids=prompt,
        output_token_ids=outputs,
        forbidden_token_ids=[],
        prompt_logprobs_range=None,
        seed=None,
    )


PARAMS = SamplingParams(temperature=0.0, max_tokens=16)


def send(encoder: PlanEncoder, decoder: PlanDecoder, plan: SchedulerOutput) -> StepPlanData:
    data = msgspec.msgpack.decode(msgspec.msgpack.encode(encoder.encode(plan)), type=StepPlanData)
    assert_same_plan(decoder.decode(data), plan)
    return data


def test_jump_forward_tokens_a_reused_id_and_a_changed_table_are_exact() -> None:
    encoder, decoder = PlanEncoder(), PlanDecoder()
    prompt, outputs, table = [1, 2, 3, 4, 5], [], [7, 8]
    first = send(encoder, decoder, SchedulerOutput([entry("a", prompt, outputs, table, 0, 5)]))
    assert len(first.new_requests) == 1
    outputs += [40, 41, 42, 43]  # a sampled token and three jump-forward appended
    table += [9, 3]
    data = send(encoder, decoder, SchedulerOutput([entry("a", prompt, outputs, table, 5, 4)]))
    assert not data.new_requests and data.scheduled[0].new_output_token_ids == [40, 41, 42, 43]
    assert data.scheduled[0].new_block_ids == [9, 3]
    table[0] = RELEASED_BLOCK  # released out of the window
    outputs.append(44)
    data = send(encoder, decoder, SchedulerOutput([entry("a", prompt, outputs, table, 9, 1)]))
    assert not data.new_requests and data.scheduled[0].changed_blocks == [(0, RELEASED_BLOCK)]
    # Entries swapped in place (a sibling's copy for the shared block) are changes of entries.
    data = send(encoder, decoder, SchedulerOutput([entry("a", prompt, outputs, [5, 6, 9, 4], 0, 10)]))
    assert not data.new_requests and data.scheduled[0].changed_blocks == [(0, 5), (1, 6), (3, 4)]
    assert data.scheduled[0].new_block_ids == []
    # Outputs that are not the sent ones plus more (never made today; speculative rollback) and a
    # shorter table are sent in full.
    data = send(encoder, decoder, SchedulerOutput([entry("a", prompt, outputs[:2] + [77], [5, 6], 0, 8)]))
    assert len(data.new_requests) == 1
    # A new request under a finished one's id (another prompt object) is sent in full, never patched.
    send(encoder, decoder, SchedulerOutput([], finished_request_ids=["a"]))
    assert decoder.requests == {}
    data = send(encoder, decoder, SchedulerOutput([entry("a", [1, 2, 3, 4, 5], [], [7, 8], 0, 5)]))
    assert len(data.new_requests) == 1


def test_grammar_bitmasks_and_outputs_cross_the_wire_unchanged() -> None:
    encoder, decoder = PlanEncoder(), PlanDecoder()
    bitmask = torch.tensor([[-1, 0, 5], [7, -8, 1 << 30]], dtype=torch.int32)  # [2 rows, 3 words]
    plan = SchedulerOutput(
        [entry("a", [1, 2], [], [0], 0, 2), entry("b", [3, 4], [], [1], 0, 2)],
        grammar_bitmask=GrammarBitmask(rows={"b": 1, "a": 0}, bitmask=bitmask),
        pausable=True,
        shared_sources=["a"],
        propose_drafts=False,
    )
    data = msgspec.msgpack.decode(msgspec.msgpack.encode(encoder.encode(plan)), type=StepPlanData)
    rebuilt = decoder.decode(data)
    assert rebuilt.grammar_bitmask is not None and rebuilt.grammar_bitmask.rows == {"b": 1, "a": 0}
    assert torch.equal(rebuilt.grammar_bitmask.bitmask, bitmask)
    assert rebuilt.propose_drafts is False
    output = ModelRunnerOutput(
        sampled_token_ids={"a": 3},
        logprobs={"a": PositionLogprobs(token_ids=[3, 1], logprobs=[-0.1, -2.5], rank=1)},
        prompt_logprobs={"b": [PositionLogprobs(token_ids=[4], logprobs=[-1.0], rank=2)]},
        draft_token_ids={"a": [5, 6]},
    )
    wire = msgspec.msgpack.encode(output_to_wire(output))
    assert output_from_wire(msgspec.msgpack.decode(wire, type=StepDone)) == output
    paused = ModelRunnerOutput(status=StepStatus.PAUSED, layers_done=0.25)
    assert (
        output_from_wire(
            msgspec.msgpack.decode(msgspec.msgpack.encode(output_to_wire(paused)), type=StepDone)
        )
        == paused
    )
