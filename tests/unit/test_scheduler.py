"""The scheduler and KV cache manager alone: token ids in, plans out, no model and no torch.

A ``FakeRunner`` stands in for the model. It keeps one token per KV slot, writes each step's tokens
into the slots of the request's block table, and "samples" a function of the whole context it reads
back through that table. A request whose blocks were shared, cached, evicted or recomputed wrongly
therefore produces different tokens from ``reference()``, which generates without any cache.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.config import SchedulerConfig
from tokenmill.core.kv.manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.step_io import ModelRunnerOutput, SchedulerOutput
from tokenmill.protocol import EngineCoreOutput, EngineCoreRequest
from tokenmill.sampling_params import SamplingParams

MAX_MODEL_LEN = 256


def next_token(context: list[int | None]) -> int:
    """The fake model: a deterministic token in [10, 99) that depends on every context token."""
    assert None not in context, "read a KV slot that was never written"
    return 10 + sum((i + 1) * t for i, t in enumerate(context)) % 89  # type: ignore[operator]


def reference(prompt: list[int], num_new: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_new):
        tokens.append(next_token(tokens))  # type: ignore[arg-type]
    return tokens[len(prompt) :]


class FakeRunner:
    """Plays the model runner: writes every scheduled token's KV, then samples from what it reads."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, int] = {}

    def slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        for entry in plan.scheduled:
            for i, token in enumerate(entry.token_ids):
                self.slots[self.slot(entry.block_table, entry.start_position + i)] = token
        result = ModelRunnerOutput()
        for entry in plan.scheduled:
            if entry.sample:
                end = entry.start_position + len(entry.token_ids)
                context = [self.slots.get(self.slot(entry.block_table, p)) for p in range(end)]
                result.sampled_token_ids[entry.request_id] = next_token(context)
        return result


class Harness:
    """A scheduler over a KV manager, driven step by step with the fake runner."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 4,
        budget: int = 64,
        max_num_seqs: int = 64,
        prefix_caching: bool = False,
        sliding_window: int | None = None,
        admission: str = "fill",
    ) -> None:
        self.kv = KVCacheManager(
            num_blocks, block_size, enable_prefix_caching=prefix_caching, sliding_window=sliding_window
        )
        config = SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, admission=admission
        )
        self.scheduler = Scheduler(config, self.kv, MAX_MODEL_LEN)
        self.runner = FakeRunner(block_size)
        self.outputs: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}
        self.plans: list[SchedulerOutput] = []

    def add(self, request_id: str, prompt: list[int], max_tokens: int, **kwargs: object) -> Request:
        request = make_request(request_id, prompt, max_tokens, **kwargs)
        self.scheduler.add_request(request)
        self.outputs[request_id] = []
        return request

    def step(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        plan = self.scheduler.schedule()
        self.check_plan(plan)
        outputs = self.scheduler.update(plan, self.runner.execute(plan))
        if self.scheduler.config.admission == "ttft":
            # A fake machine's step times (4 ms a step, 1 ms a token, 2 ms a sequence) teach the
            # scheduler's step-time model, which sizes the ttft admissions.
            seconds = 0.004 + 0.001 * plan.num_tokens + 0.002 * len(plan.scheduled)
            self.scheduler.record_step_time(plan, seconds)
        for output in outputs:
            self.outputs[output.request_id].extend(output.new_token_ids)
            if output.finish_reason is not None:
                self.finish_reasons[output.request_id] = output.finish_reason.value
        self.plans.append(plan)
        self.kv.check_integrity()
        return plan, outputs

    def check_plan(self, plan: SchedulerOutput) -> None:
        assert plan.num_tokens <= self.scheduler.config.max_num_batched_tokens
        assert len({e.request_id for e in plan.scheduled}) == len(plan.scheduled)
        for entry in plan.scheduled:
            needed = -(-(entry.start_position + len(entry.token_ids)) // self.kv.block_size)
            assert len(entry.block_table) >= needed, "a step was planned without its blocks"
            assert entry.token_ids, "an entry with nothing to compute"

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                break
            plan, _ = self.step()
            assert not plan.is_empty, "unfinished requests but nothing scheduled: deadlock"
        assert not self.scheduler.has_unfinished()
        self.assert_all_blocks_back()

    def assert_all_blocks_back(self) -> None:
        self.kv.check_integrity()
        assert self.kv.all_free_or_cached()
        cached = self.kv.radix.cached_blocks if self.kv.radix is not None else 0
        assert self.kv.pool.num_free == self.kv.num_blocks - cached


def make_request(
    request_id: str, prompt: list[int], max_tokens: int, max_model_len: int = MAX_MODEL_LEN, **kwargs: object
) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    fields = {"request_id": request_id, "prompt_token_ids": prompt, "sampling_params": params, **kwargs}
    return Request(EngineCoreRequest(**fields), max_model_len)  # type: ignore[arg-type]


def ids(plan: SchedulerOutput) -> list[str]:
    return [e.request_id for e in plan.scheduled]


def prompt_of(length: int, start: int = 1) -> list[int]:
    return [start + i for i in range(length)]


# ---------------------------------------------------------------- the single rule


def test_chunked_prefill_splits_a_prompt_across_steps() -> None:
    h = Harness(num_blocks=16, budget=8)
    prompt = prompt_of(20)
    h.add("a", prompt, max_tokens=3)
    chunks = []
    for _ in range(3):
        plan, _ = h.step()
        (entry,) = plan.scheduled
        chunks.append((entry.start_position, entry.token_ids, entry.sample))
    assert chunks == [(0, prompt[:8], False), (8, prompt[8:16], False), (16, prompt[16:], True)]
    assert h.outputs["a"] == reference(prompt, 1)
    plan, _ = h.step()
    assert [(e.start_position, len(e.token_ids), e.sample) for e in plan.scheduled] == [(20, 1, True)]
    h.run()
    assert h.outputs["a"] == reference(prompt, 3)
    assert h.finish_reasons["a"] == "length"


def test_prefill_and_decode_mix_in_one_step() -> None:
    h = Harness(num_blocks=16, budget=8)
    h.add("decoder", prompt_of(4), max_tokens=5)
    h.step()  # the short prompt is computed and its first token sampled
    h.add("prefiller", prompt_of(12, start=50), max_tokens=2)
    plan, _ = h.step()
    decode, chunk = plan.scheduled
    assert (decode.request_id, len(decode.token_ids), decode.sample) == ("decoder", 1, True)
    assert (chunk.request_id, chunk.start_position, len(chunk.token_ids)) == ("prefiller", 0, 7)
    assert not chunk.sample
    h.run()
    assert h.outputs == {"decoder": reference(prompt_of(4), 5), "prefiller": reference(prompt_of(12, 50), 2)}


def test_running_requests_are_served_before_waiting_ones() -> None:
    h = Harness(num_blocks=32, budget=3)
    for name in "abc":
        h.add(name, [ord(name)], max_tokens=4)
    plan, _ = h.step()
    assert ids(plan) == ["a", "b", "c"]
    h.add("late", prompt_of(6), max_tokens=2)
    for _ in range(3):  # the three decodes use the whole budget, so the newcomer waits
        plan, _ = h.step()
        assert ids(plan) == ["a", "b", "c"]
        assert h.scheduler.num_waiting == 1
    plan, _ = h.step()  # a, b and c are done: now it runs
    assert ids(plan) == ["late"]
    h.run()
    assert h.outputs["late"] == reference(prompt_of(6), 2)


def test_max_num_seqs_caps_the_running_set() -> None:
    h = Harness(num_blocks=32, max_num_seqs=2)
    for name in "abc":
        h.add(name, prompt_of(3, start=ord(name)), max_tokens=2)
    plan, _ = h.step()
    assert ids(plan) == ["a", "b"] and h.scheduler.num_running == 2
    h.run()
    assert all(h.outputs[n] == reference(prompt_of(3, ord(n)), 2) for n in "abc")


def test_preemption_evicts_the_most_recently_admitted_and_it_resumes_with_the_same_tokens() -> None:
    # Six blocks of four: a (8 tokens) needs a third block at its first decode while b and c hold
    # two each. The victim must be c, the last admitted, even though a is the one asking.
    h = Harness(num_blocks=6, budget=64)
    prompts = {"a": prompt_of(8, 1), "b": prompt_of(6, 30), "c": prompt_of(6, 60)}
    requests = {name: h.add(name, prompt, max_tokens=6) for name, prompt in prompts.items()}
    plan, _ = h.step()
    assert ids(plan) == ["a", "b", "c"] and h.kv.pool.num_free == 0

    plan, _ = h.step()
    assert plan.num_preempted == 1 and h.scheduler.num_preemptions_total == 1
    assert ids(plan) == ["a", "b"]
    c = requests["c"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert not h.kv.has_allocation("c")
    tokens_at_preemption = list(c.all_token_ids)
    assert len(tokens_at_preemption) == 7  # its prompt and the one token it had sampled

    resumed = None
    while h.scheduler.has_unfinished():
        plan, _ = h.step()
        entry = next((e for e in plan.scheduled if e.request_id == "c"), None)
        if entry is not None and resumed is None:
            resumed = entry
    assert resumed is not None
    assert resumed.start_position == 0 and resumed.token_ids == tokens_at_preemption and resumed.sample
    for name, prompt in prompts.items():
        assert h.outputs[name] == reference(prompt, 6), name
    h.assert_all_blocks_back()


def test_preemption_of_a_long_generation_under_a_tiny_budget_never_deadlocks() -> None:
    h = Harness(num_blocks=8, budget=5)
    prompts = [prompt_of(7, 10 * k) for k in range(4)]
    for k, prompt in enumerate(prompts):
        h.add(str(k), prompt, max_tokens=20)
    h.run()
    assert h.scheduler.num_preemptions_total > 0
    assert all(h.outputs[str(k)] == reference(p, 20) for k, p in enumerate(prompts))


def test_a_request_larger_than_the_whole_pool_is_rejected_at_add_request() -> None:
    h = Harness(num_blocks=4)  # 16 tokens in all
    with pytest.raises(ValueError, match="pool"):
        h.add("huge", prompt_of(10), max_tokens=10)
    with pytest.raises(ValueError, match="context window"):
        h.add("long", prompt_of(MAX_MODEL_LEN), max_tokens=1)
    with pytest.raises(ValueError, match="at least one token"):
        h.add("empty", [], max_tokens=1)
    assert not h.scheduler.has_unfinished() and h.kv.pool.num_free == 4
    h.add("fits", prompt_of(10), max_tokens=6)  # exactly the pool
    h.run()
    assert h.outputs["fits"] == reference(prompt_of(10), 6)


def test_abort_releases_blocks_wherever_the_request_is() -> None:
    h = Harness(num_blocks=16, budget=6)
    h.add("running", prompt_of(5), max_tokens=8)
    h.add("chunked", prompt_of(9, 40), max_tokens=8)
    h.add("waiting", prompt_of(4, 80), max_tokens=8)
    h.step()
    assert h.kv.has_allocation("running") and h.kv.has_allocation("chunked")
    assert h.scheduler.abort(["chunked", "waiting", "unknown"]) == ["chunked", "waiting"]
    assert not h.kv.has_allocation("chunked")
    plan = h.scheduler.schedule()
    assert ids(plan) == ["running"] and sorted(plan.finished_request_ids) == ["chunked", "waiting"]
    h.scheduler.update(plan, h.runner.execute(plan))
    h.scheduler.abort(["running"])
    h.assert_all_blocks_back()


# ---------------------------------------------------------------- prefix cache


def test_prefix_cache_hits_advance_by_whole_blocks_and_leave_a_token_to_compute() -> None:
    h = Harness(num_blocks=32, prefix_caching=True)
    base = prompt_of(10, 100)
    h.add("first", base, max_tokens=2)
    h.run()  # caches the two full blocks of its prompt

    cases = {
        "longer": (base[:8] + [7, 7, 7, 7], 8),  # two cached blocks, then its own tokens
        "exact": (base[:8], 4),  # fully cached, but one block is kept back to have a token to run
        "one-more": (base[:9], 8),
        "diverges": (base[:5] + [1, 2, 3], 4),  # only the first block matches
        "short": (base[:3], 0),  # no full block at all
    }
    for name, (prompt, _) in cases.items():
        h.add(name, prompt, max_tokens=3)
    plan, _ = h.step()
    starts = {e.request_id: e.start_position for e in plan.scheduled}
    for name, (prompt, expected) in cases.items():
        assert starts[name] == expected, name
        assert starts[name] % h.kv.block_size == 0 and starts[name] < len(prompt)
        assert h.scheduler.requests[name].num_cached_tokens == expected
    h.run()
    for name, (prompt, _) in cases.items():
        assert h.outputs[name] == reference(prompt, 3), name  # the cached KV was the right KV


def test_prefix_cache_on_and_off_agree_under_pressure() -> None:
    prompts = [prompt_of(6, 1) + prompt_of(k + 1, 200) for k in range(6)]
    results = []
    for caching in (False, True):
        h = Harness(num_blocks=10, budget=7, prefix_caching=caching)
        for k, prompt in enumerate(prompts):
            h.add(str(k), prompt, max_tokens=5)
        h.run()
        results.append(h.outputs)
        assert all(h.outputs[str(k)] == reference(p, 5) for k, p in enumerate(prompts))
    assert results[0] == results[1]


def test_siblings_share_the_prompt_blocks_of_the_first_sample() -> None:
    h = Harness(num_blocks=32)
    prompt = prompt_of(10)
    for i in range(3):
        h.add(f"g-{i}", prompt, max_tokens=4, group_id="g", sibling_index=i)
    plan, _ = h.step()
    # The others join the step that computes the leader's prompt blocks (written before anyone
    # attends) and compute only their last, partial block.
    starts = {e.request_id: e.start_position for e in plan.scheduled}
    assert starts == {"g-0": 0, "g-1": 8, "g-2": 8}
    tables = [h.kv.block_table(f"g-{i}") for i in range(3)]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert all(h.kv.pool.ref_count(b) == 3 for b in tables[0][:2])
    assert len(set(tables[0][2:]) | set(tables[1][2:]) | set(tables[2][2:])) == 3  # own last blocks
    h.run()
    assert all(h.outputs[f"g-{i}"] == reference(prompt, 4) for i in range(3))


def test_a_request_waits_for_a_prefix_another_request_is_computing_then_shares_it() -> None:
    # Four requests share a 3-block prefix that is not cached yet. Only the first computes it (in two
    # chunks); the others wait, then share all three blocks instead of computing copies alongside:
    # q1 joins the very step that completes them (the step writes every KV before anyone attends),
    # q2 and q3 match them in the tree a step later, when q1's chunk has taken the budget.
    h = Harness(num_blocks=64, budget=8, prefix_caching=True)
    shared = prompt_of(12, 100)
    prompts = {f"q{k}": shared + prompt_of(3, 10 * k + 1) for k in range(4)}
    prompts["other"] = prompt_of(6, 500)  # shares nothing with them
    requests = {name: h.add(name, prompt, max_tokens=3) for name, prompt in prompts.items()}
    plan, _ = h.step()
    assert ids(plan) == ["q0"]  # q1..q3 wait for q0's blocks; q0's 8-token chunk takes the budget
    plan, _ = h.step()
    # q0's last 7 tokens complete the prefix; q1 starts past it in the same step, on q0's blocks.
    assert [(e.request_id, e.start_position) for e in plan.scheduled] == [("q0", 8), ("q1", 12)]
    assert h.kv.block_table("q1")[:3] == h.kv.block_table("q0")[:3]
    h.run()
    first_start = {}
    for plan in h.plans:
        for entry in plan.scheduled:
            first_start.setdefault(entry.request_id, entry.start_position)
    assert first_start == {"q0": 0, "other": 0, "q1": 12, "q2": 12, "q3": 12}
    assert [requests[f"q{k}"].num_cached_tokens for k in range(4)] == [0, 12, 12, 12]
    assert all(h.outputs[name] == reference(p, 3) for name, p in prompts.items())


def test_only_blocks_the_planned_step_completes_are_offered_for_sharing() -> None:
    # q0 has computed 2 of the 3 blocks it shares with q1 (they are in the tree). A step that takes
    # q0 to 11 tokens completes no further block: nothing better than the tree to offer. One that
    # takes it to 13 completes the third block, offered to q1 but not to q2, whose whole prompt is
    # the shared part (it keeps a token to compute, so it can use two blocks, which the tree holds).
    h = Harness(num_blocks=64, budget=8, prefix_caching=True)
    shared = prompt_of(12, 100)
    q0 = h.add("q0", shared + prompt_of(3, 1), max_tokens=2)
    q1 = h.add("q1", shared + [7], max_tokens=2)
    q2 = h.add("q2", shared, max_tokens=2)
    plan, _ = h.step()
    assert ids(plan) == ["q0"] and q0.num_computed_tokens == 8
    assert h.kv.peek_prefix_tokens(q1) == 8
    assert h.kv.prefix_computed_by(q1, [(q0, 11)]) == ("", 0)
    assert h.kv.prefix_computed_by(q1, [(q0, 13)]) == ("q0", 12)
    assert h.kv.prefix_computed_by(q2, [(q0, 13)]) == ("", 0)
    h.run()
    h.assert_all_blocks_back()


@pytest.mark.parametrize("tier", ["flex", "priority"])
def test_only_publishing_requests_of_the_same_or_a_better_class_are_waited_for(tier: str) -> None:
    h = Harness(num_blocks=64, budget=8, prefix_caching=True)
    shared = prompt_of(12, 300)
    h.add("flex", shared + [1], max_tokens=2, service_tier="flex")
    h.step()  # two of its four blocks computed and cached
    h.add("late", shared + [2], max_tokens=2, service_tier=tier)
    plan, _ = h.step()
    starts = {e.request_id: e.start_position for e in plan.scheduled}
    if tier == "flex":
        # Shares the third block, which the flex request computes in this very step.
        assert starts == {"flex": 8, "late": 12}
    else:
        # A priority request does not wait on a worse class, which may not progress soon.
        assert starts == {"late": 8, "flex": 8}
    h.run()
    assert h.outputs["late"] == reference(shared + [2], 2)

    # A request with prompt logprobs never publishes its blocks, so nobody waits for it.
    h = Harness(num_blocks=64, budget=64, prefix_caching=True)
    logprobs = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    h.add("logprobs", shared + [1], max_tokens=2, sampling_params=logprobs)
    h.add("plain", shared + [3], max_tokens=2)
    plan, _ = h.step()
    assert ids(plan) == ["logprobs", "plain"]


# ---------------------------------------------------------------- everything at once, at random


@st.composite
def workloads(draw):  # type: ignore[no-untyped-def]
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(4, 24))
    prefixes = [draw(st.lists(st.integers(1, 9), min_size=0, max_size=8)) for _ in range(2)]
    requests = []
    for _ in range(draw(st.integers(1, 7))):
        prefix = draw(st.sampled_from(prefixes))
        prompt = prefix + draw(st.lists(st.integers(1, 9), min_size=1 if not prefix else 0, max_size=8))
        max_tokens = draw(st.integers(1, 8))
        if len(prompt) + max_tokens > num_blocks * block_size:
            continue
        arrival = draw(st.integers(0, 6))
        abort_at = draw(st.one_of(st.none(), st.integers(arrival, arrival + 6)))
        requests.append((prompt, max_tokens, arrival, abort_at))
    return {
        "block_size": block_size,
        "num_blocks": num_blocks,
        "budget": draw(st.integers(1, 16)),
        "max_num_seqs": draw(st.integers(1, 6)),
        "prefix_caching": draw(st.booleans()),
        "admission": draw(st.sampled_from(["fill", "ttft"])),
        "requests": requests,
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_every_invariant(workload) -> None:  # type: ignore[no-untyped-def]
    requests = [
        (str(k), prompt, max_tokens, arrival, abort_at, {})
        for k, (prompt, max_tokens, arrival, abort_at) in enumerate(workload["requests"])
    ]
    run_workload(workload, requests)


@st.composite
def shared_prefix_workloads(draw):  # type: ignore[no-untyped-def]
    """Bursts of requests over a few long common prefixes, some of them n > 1 groups: most admissions
    find a prefix that another request computes in the same step (same-step sharing), or wait for it."""
    block_size = draw(st.sampled_from([2, 4]))
    num_blocks = draw(st.integers(8, 30))
    prefixes = [
        draw(st.lists(st.integers(1, 9), min_size=4, max_size=16)) for _ in range(draw(st.integers(1, 3)))
    ]
    requests = []
    for k in range(draw(st.integers(2, 8))):
        prompt = draw(st.sampled_from(prefixes)) + draw(st.lists(st.integers(1, 9), min_size=1, max_size=4))
        max_tokens = draw(st.integers(1, 5))
        if len(prompt) + max_tokens > num_blocks * block_size:
            continue
        arrival = draw(st.integers(0, 2))
        abort_at = draw(st.one_of(st.none(), st.none(), st.integers(arrival, arrival + 4)))
        n = draw(st.sampled_from([1, 1, 2, 3]))
        for i in range(n):
            siblings = {"group_id": f"g{k}", "sibling_index": i} if n > 1 else {}
            requests.append((f"g{k}-{i}", prompt, max_tokens, arrival, abort_at, siblings))
    return {
        "block_size": block_size,
        "num_blocks": num_blocks,
        "budget": draw(st.integers(4, 48)),
        "max_num_seqs": draw(st.integers(2, 8)),
        "prefix_caching": True,
        "admission": draw(st.sampled_from(["fill", "ttft"])),
        "requests": requests,
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared_prefix_workloads())
def test_bursts_over_shared_prefixes_keep_every_invariant(workload) -> None:  # type: ignore[no-untyped-def]
    run_workload(workload, workload["requests"])


def run_workload(workload, requests) -> None:  # type: ignore[no-untyped-def]
    """Drive ``requests`` (id, prompt, max_tokens, arrival step, abort step or None, extra request
    fields) through a harness shaped by ``workload``, checking every plan and the outputs."""
    h = Harness(
        num_blocks=workload["num_blocks"],
        block_size=workload["block_size"],
        budget=workload["budget"],
        max_num_seqs=workload["max_num_seqs"],
        prefix_caching=workload["prefix_caching"],
        admission=workload.get("admission", "fill"),
    )
    last_arrival = max((arrival for _, _, _, arrival, _, _ in requests), default=0)
    aborted: set[str] = set()
    for step in range(2000):
        for request_id, prompt, max_tokens, arrival, abort_at, fields in requests:
            if arrival == step:
                h.add(request_id, prompt, max_tokens, **fields)
            if abort_at == step and request_id in h.scheduler.requests:
                h.scheduler.abort([request_id])
                aborted.add(request_id)
        if step > last_arrival and not h.scheduler.has_unfinished():
            break
        had_work = h.scheduler.has_unfinished()
        running_before = [r.request_id for r in h.scheduler.running]
        plan, _ = h.step()
        assert not had_work or not plan.is_empty, "unfinished requests but nothing scheduled"
        # Running requests come first in the plan, in their admission order.
        planned = ids(plan)
        kept = [r for r in running_before if r in planned]
        assert planned[: len(kept)] == kept
    else:
        pytest.fail("the workload never finished")
    h.assert_all_blocks_back()
    for request_id, prompt, max_tokens, _, _, _ in requests:
        out = h.outputs[request_id]
        if request_id in aborted:
            assert out == reference(prompt, max_tokens)[: len(out)]
        else:
            assert out == reference(prompt, max_tokens), request_id
            assert h.finish_reasons[request_id] == "length"
