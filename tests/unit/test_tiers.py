"""Service tiers, priorities, per-user fairness (VTC), latency guard, queue bounds and deadlines.

Scheduler-level and deterministic: the ``FakeRunner`` of ``test_scheduler`` plays the model (so
tokens prove that preempted and resumed requests recompute the right KV), and an injected clock
stands in for wall time wherever deadlines and latency targets need one.
"""

from __future__ import annotations

import argparse

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import MAX_MODEL_LEN, FakeRunner, make_request, prompt_of, reference

from tokenmill.config import EngineConfig, SchedulerConfig, TierConfig, build_engine_config
from tokenmill.core.kv.manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.step_io import SchedulerOutput
from tokenmill.engine_args import (
    add_engine_args,
    engine_kwargs,
    parse_tier,
    parse_tier_slo,
    parse_user_weight,
)
from tokenmill.protocol import FinishReason


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TierHarness:
    """A scheduler with tiers and fairness over a KV manager, a fake model and a fake clock.

    ``seconds_per_step(plan)`` says how long each step takes on the fake clock (default: nothing);
    the scheduler's step-time model is fed those times.
    """

    def __init__(
        self,
        num_blocks: int = 64,
        block_size: int = 4,
        budget: int = 64,
        max_num_seqs: int = 64,
        prefix_caching: bool = False,
        seconds_per_step: object = None,
        max_model_len: int = MAX_MODEL_LEN,
        **config: object,
    ) -> None:
        self.clock = Clock()
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            **config,  # type: ignore[arg-type]
        )
        scheduler_config.validate()
        self.scheduler = Scheduler(scheduler_config, self.kv, max_model_len, clock=self.clock)
        self.runner = FakeRunner(block_size)
        self.seconds_per_step = seconds_per_step
        self.outputs: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}
        self.prompts: dict[str, list[int]] = {}

    def add(self, request_id: str, prompt: list[int], max_tokens: int, **kwargs: object) -> Request:
        kwargs.setdefault("arrival_time", self.clock.now)
        request = make_request(request_id, prompt, max_tokens, self.scheduler.max_model_len, **kwargs)
        self.scheduler.add_request(request)
        self.outputs[request_id] = []
        self.prompts[request_id] = prompt
        return request

    def step(self) -> SchedulerOutput:
        return self.finish_step(self.scheduler.schedule())

    def finish_step(self, plan: SchedulerOutput) -> SchedulerOutput:
        """Execute ``plan`` on the fake model and apply its results, as a step does."""
        assert plan.num_tokens <= self.scheduler.config.max_num_batched_tokens
        assert all(entry.token_ids for entry in plan.scheduled)
        result = self.runner.execute(plan)
        if callable(self.seconds_per_step):
            seconds = self.seconds_per_step(plan)
            self.clock.now += seconds
            self.scheduler.record_step_time(plan, seconds)  # as the engine core does with wall time
        for output in self.scheduler.update(plan, result):
            self.outputs[output.request_id].extend(output.new_token_ids)
            if output.finish_reason is not None:
                self.finish_reasons[output.request_id] = output.finish_reason.value
        self.kv.check_integrity()
        return plan

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                break
            self.step()
        assert not self.scheduler.has_unfinished()
        self.assert_all_blocks_back()

    def assert_all_blocks_back(self) -> None:
        self.kv.check_integrity()
        assert self.kv.all_free_or_cached()
        cached = self.kv.radix.cached_blocks if self.kv.radix is not None else 0
        assert self.kv.pool.num_free == self.kv.num_blocks - cached

    def assert_outputs_match_reference(self) -> None:
        for request_id, prompt in self.prompts.items():
            expected = reference(prompt, len(self.outputs[request_id]))
            assert self.outputs[request_id] == expected, request_id


def ids(plan: SchedulerOutput) -> list[str]:
    return [e.request_id for e in plan.scheduled]


# ---------------------------------------------------------------- fairness: the virtual token counter


class ServiceMeter:
    """Measures each user's service from the plans alone, the way the paper defines it: ``w_p`` per
    prompt token computed (once per request, recomputation is the server's cost) plus ``w_q`` per
    generated token, divided by the user's weight."""

    def __init__(self, users: dict[str, str], w_p: float, w_q: float, weights: dict[str, float]) -> None:
        self.users = users  # request id -> user
        self.w_p, self.w_q, self.weights = w_p, w_q, weights
        self.prompt_done: dict[str, int] = {}
        self.service: dict[str, float] = {u: 0.0 for u in set(users.values())}

    def record(self, plan: SchedulerOutput, prompt_lengths: dict[str, int]) -> None:
        for entry in plan.scheduled:
            user = self.users[entry.request_id]
            end = min(entry.start_position + len(entry.token_ids), prompt_lengths[entry.request_id])
            new_prompt = max(0, end - self.prompt_done.get(entry.request_id, 0))
            self.prompt_done[entry.request_id] = max(end, self.prompt_done.get(entry.request_id, 0))
            cost = self.w_p * new_prompt + (self.w_q if entry.sample else 0.0)
            self.service[user] += cost / self.weights.get(user, 1.0)


def flood_and_trickle(policy: str, weights: dict[str, float]) -> tuple[float, float, int]:
    """A heavy user queues 30 long requests, then a light user 40 short ones; both stay backlogged
    for a while. Returns the largest service gap seen while both were backlogged, the bound, and
    how many steps that was."""
    w_p, w_q = 1.0, 2.0
    h = TierHarness(num_blocks=16, budget=16, max_num_seqs=4, policy=policy, user_weights=weights)
    users: dict[str, str] = {}
    for k in range(30):
        h.add(f"heavy-{k}", prompt_of(12, 3 * k), max_tokens=8, user="heavy")
        users[f"heavy-{k}"] = "heavy"
    for k in range(40):
        h.add(f"light-{k}", prompt_of(4, 200 + k), max_tokens=3, user="light")
        users[f"light-{k}"] = "light"
    meter = ServiceMeter(users, w_p, w_q, weights)
    lengths = {rid: len(p) for rid, p in h.prompts.items()}
    longest_prompt = max(lengths.values())
    batch_tokens = h.kv.capacity_tokens  # most tokens that can be in the running batch at once
    bound = 2 * max(w_p * longest_prompt, w_q * batch_tokens)
    worst_gap, steps = 0.0, 0

    def backlogged(user: str) -> bool:
        return any(r.user == user for r in h.scheduler.waiting.ordered())

    while backlogged("heavy") and backlogged("light"):
        meter.record(h.step(), lengths)
        steps += 1
        worst_gap = max(worst_gap, abs(meter.service["heavy"] - meter.service["light"]))
    h.run()
    h.assert_outputs_match_reference()
    return worst_gap, bound, steps


def test_vtc_keeps_two_backlogged_users_within_the_papers_bound() -> None:
    """Sheng et al. (OSDI 2024), the 2x bound: for two clients backlogged over an interval, VTC keeps
    the difference of their (weighted) service within ``2 * max(w_p * L_input, w_q * M)``, where
    ``L_input`` is the longest prompt and ``M`` the most tokens the running batch can hold (here the
    KV pool). We check it after every step while both users have waiting requests, with weights
    1:1 and 2:1 (service divided by weight), and check that FCFS, under the same load, breaks it."""
    for weights in ({}, {"light": 2.0}):
        gap, bound, steps = flood_and_trickle("vtc", weights)
        assert steps >= 20, "the users were not both backlogged long enough to test anything"
        assert gap <= bound, (weights, gap, bound)
    fcfs_gap, bound, _ = flood_and_trickle("fcfs", {})
    assert fcfs_gap > bound


def test_vtc_schedules_a_light_user_ahead_of_a_heavy_users_queue() -> None:
    h = TierHarness(num_blocks=64, budget=32, max_num_seqs=1, policy="vtc")
    for k in range(5):
        h.add(f"flood-{k}", prompt_of(8, 10 * k), max_tokens=6, user="heavy")
    h.step()  # flood-0 runs alone (one seat)
    h.add("light-0", prompt_of(4, 90), max_tokens=2, user="light")
    h.add("light-1", prompt_of(4, 95), max_tokens=2, user="light")
    order: list[str] = []
    while h.scheduler.has_unfinished():
        for entry in h.step().scheduled:
            if entry.request_id not in order:
                order.append(entry.request_id)
    # flood-0 finishes first (it holds the seat); then the light user's work, then the flood's queue.
    assert order[:3] == ["flood-0", "light-0", "light-1"]
    assert order[3:] == [f"flood-{k}" for k in range(1, 5)]
    counters = h.scheduler.fairness
    assert counters is not None and counters.counter("heavy") > counters.counter("light")
    h.assert_outputs_match_reference()
    h.assert_all_blocks_back()


def test_a_newly_backlogged_user_is_lifted_to_the_smallest_backlogged_counter() -> None:
    h = TierHarness(num_blocks=64, budget=64, max_num_seqs=1, policy="vtc")
    h.add("a-0", prompt_of(10), max_tokens=2, user="a")
    h.add("a-1", prompt_of(10, 30), max_tokens=2, user="a")
    while h.outputs["a-0"] == [] or h.scheduler.requests.get("a-0") is not None:
        h.step()
    counters = h.scheduler.fairness
    assert counters is not None
    served = counters.counter("a")
    assert served == pytest.approx(10 * 1.0 + 2 * 2.0)  # the prompt, then two generated tokens
    # "b" arrived idle: it does not bank credit for the time it was away.
    h.add("b-0", prompt_of(4, 60), max_tokens=2, user="b")
    assert counters.counter("b") == pytest.approx(counters.counter("a"))
    h.run()


# ---------------------------------------------------------------- tiers and priorities


def test_auto_means_default_and_unknown_tiers_are_refused() -> None:
    h = TierHarness()
    assert h.add("auto", prompt_of(3), 1, service_tier="auto").tier == "default"
    with pytest.raises(ValueError, match="service_tier 'gold' is not offered.*auto, priority, default, flex"):
        h.add("gold", prompt_of(3), 1, service_tier="gold")
    assert "gold" not in h.scheduler.requests
    h.run()


def test_classes_are_admitted_best_first_then_by_priority_value() -> None:
    h = TierHarness(max_num_seqs=1)
    h.add("flex", prompt_of(3, 1), 1, service_tier="flex")
    h.add("default-late", prompt_of(3, 10), 1, priority=5)
    h.add("default-urgent", prompt_of(3, 20), 1, priority=-1)
    h.add("priority", prompt_of(3, 30), 1, service_tier="priority", priority=9)
    order = [ids(h.step())[0] for _ in range(4)]
    assert order == ["priority", "default-urgent", "default-late", "flex"]
    h.run()


def test_a_better_tier_preempts_a_worse_one_for_blocks_and_both_finish_correctly() -> None:
    # Eight blocks of four: two default requests take all of them, then a priority request arrives.
    h = TierHarness(num_blocks=8, budget=64)
    h.add("default-a", prompt_of(12, 1), max_tokens=4)
    h.add("default-b", prompt_of(12, 40), max_tokens=4)
    h.step()
    assert h.kv.pool.num_free == 2
    h.add("vip", prompt_of(10, 80), max_tokens=4, service_tier="priority")
    plan = h.step()
    # The most recently admitted default request made room; the vip runs in the same step.
    assert plan.num_preempted == 1
    assert h.scheduler.requests["default-b"].status == RequestStatus.PREEMPTED
    assert ids(plan)[0] == "vip"
    h.run()
    h.assert_outputs_match_reference()
    assert all(len(h.outputs[r]) == 4 for r in ("default-a", "default-b", "vip"))


def test_a_better_tier_takes_a_seat_from_flex_but_never_from_its_equals() -> None:
    h = TierHarness(max_num_seqs=2)
    h.add("flex", prompt_of(4, 1), max_tokens=6, service_tier="flex")
    h.add("default-a", prompt_of(4, 20), max_tokens=6)
    h.step()
    h.add("default-b", prompt_of(4, 40), max_tokens=6)
    plan = h.step()
    assert set(ids(plan)) == {"default-a", "default-b"}
    assert h.scheduler.requests["flex"].status == RequestStatus.PREEMPTED
    h.add("default-c", prompt_of(4, 60), max_tokens=6)
    plan = h.step()
    assert set(ids(plan)) == {"default-a", "default-b"}  # an equal class waits for a seat
    h.run()
    h.assert_outputs_match_reference()


def test_flex_runs_at_once_on_spare_capacity_and_waits_only_while_it_is_taken() -> None:
    h = TierHarness(max_num_seqs=2)
    h.add("flex-0", prompt_of(4, 1), max_tokens=2, service_tier="flex")
    assert ids(h.step()) == ["flex-0"]  # idle server: flex starts right away
    h.run()
    h.add("default-a", prompt_of(4, 10), max_tokens=3)
    h.add("default-b", prompt_of(4, 20), max_tokens=3)
    h.add("flex-1", prompt_of(4, 30), max_tokens=2, service_tier="flex")
    seats_taken = []
    while True:
        seats_taken.append(h.scheduler.num_running)
        if "flex-1" in ids(h.step()):
            break
    # It waited through the steps where both seats were taken, and started once they were free.
    assert seats_taken == [0, 2, 2, 0]
    h.run()
    h.assert_outputs_match_reference()


def test_tier_limits_cap_seats_and_step_share() -> None:
    tiers = [
        TierConfig("priority"),
        TierConfig("default"),
        TierConfig("flex", max_running=1, step_share=0.25),
    ]
    h = TierHarness(budget=16, tiers=tiers)
    h.add("flex-a", prompt_of(20, 1), max_tokens=1, service_tier="flex")
    h.add("flex-b", prompt_of(20, 30), max_tokens=1, service_tier="flex")
    h.add("default", prompt_of(6, 60), max_tokens=1)
    plan = h.step()
    tokens = {e.request_id: len(e.token_ids) for e in plan.scheduled}
    # The default tier first; flex gets a quarter of the budget though 10 tokens are left, and one seat.
    assert tokens == {"default": 6, "flex-a": 4}
    plan = h.step()
    assert {e.request_id: len(e.token_ids) for e in plan.scheduled} == {"flex-a": 4}
    h.run()
    h.assert_outputs_match_reference()


def test_slo_guard_holds_lower_tiers_to_their_guard_share_while_the_priority_tier_is_at_risk() -> None:
    # A step costs 1 ms plus 1 ms per token; the priority tier wants a token every 20 ms.
    tiers = [TierConfig("priority", tpot_slo=0.020), TierConfig("default"), TierConfig("flex")]

    def step_seconds(plan: SchedulerOutput) -> float:
        return 0.001 + 0.001 * plan.num_tokens

    h = TierHarness(budget=32, seconds_per_step=step_seconds, tiers=tiers, slo_guard_share=0.25)
    h.add("voice", prompt_of(4, 1), max_tokens=40, service_tier="priority")
    h.step()
    h.step()  # two tokens: one inter-token gap measured
    for k in range(6):
        h.add(f"bulk-{k}", prompt_of(60, 20 + k), max_tokens=2)
    gaps = []
    lower_tokens = []
    for _ in range(30):
        plan = h.step()
        lower_tokens.append(sum(len(e.token_ids) for e in plan.scheduled if e.request_id != "voice"))
        gaps.append(h.scheduler.requests["voice"].last_token_interval)
    # Unguarded, the first bulk chunk of 31 tokens makes a 33 ms step: that gap trips the guard.
    # From then on lower tiers get 8 tokens per step (10 ms steps) and every gap meets the target.
    assert lower_tokens[0] == 31 and gaps[0] == pytest.approx(0.033)
    assert set(lower_tokens[1:]) == {8}
    assert max(gaps[1:]) <= 0.010 + 1e-9  # type: ignore[type-var]
    h.run()

    # The same load without a target: lower tiers always get the whole remainder of the budget.
    h = TierHarness(budget=32, seconds_per_step=step_seconds, slo_guard_share=0.25)
    h.add("voice", prompt_of(4, 1), max_tokens=40, service_tier="priority")
    h.step()
    h.step()
    for k in range(6):
        h.add(f"bulk-{k}", prompt_of(60, 20 + k), max_tokens=2)
    plan = h.step()
    assert sum(len(e.token_ids) for e in plan.scheduled if e.request_id != "voice") == 31
    h.run()


def test_slo_guard_on_time_to_first_token() -> None:
    tiers = [TierConfig("priority", ttft_slo=1.0), TierConfig("default"), TierConfig("flex")]
    h = TierHarness(budget=32, max_num_seqs=1, tiers=tiers, slo_guard_share=0.25, slo_margin=0.5)
    h.add("bulk", prompt_of(200, 1), max_tokens=1)
    assert len(h.step().scheduled[0].token_ids) == 32
    # A priority request that cannot get a seat (bulk holds it) ages past half its target.
    caps = h.scheduler.tiers.step_caps(0.0, 32, [])
    assert caps["default"] == 32
    h.add("voice", prompt_of(4, 300), max_tokens=1, service_tier="priority", arrival_time=-0.6)
    plan = h.step()  # it takes bulk's seat (a worse class), and bulk resumes under the guard share
    assert ids(plan) == ["voice"]
    h.run()


# ---------------------------------------------------------------- overload: queue bounds and deadlines


def test_queue_bounds_refuse_instead_of_growing() -> None:
    tiers = [TierConfig("priority"), TierConfig("default", max_waiting=3), TierConfig("flex", max_waiting=1)]
    h = TierHarness(max_num_seqs=1, tiers=tiers, max_waiting=5)
    refused = {"default": 0, "flex": 0}
    for k in range(20):
        tier = "flex" if k % 2 else "default"
        if h.scheduler.queue_refusal(tier, 1) is not None:
            refused[tier] += 1
            continue
        h.add(f"r{k}", prompt_of(3, k), max_tokens=2, service_tier=tier)
    waiting = h.scheduler.waiting.waiting_by_tier()
    assert waiting == {"priority": 0, "default": 3, "flex": 1}
    assert refused == {"default": 7, "flex": 9}
    message = h.scheduler.queue_refusal("flex", 1)
    assert (
        message is not None
        and "'flex' service tier is overloaded: 1 requests are already waiting (limit 1)" in message
    )
    assert h.scheduler.queue_refusal("priority", 1) is None
    assert "the server is overloaded" in str(h.scheduler.queue_refusal("priority", 2))
    assert h.scheduler.queue_refusal("nope", 1) is None  # left to add_request's ValueError
    assert h.scheduler.retry_after() == 1.0  # nothing has finished yet
    for _ in range(6):
        h.clock.now += 0.5
        h.step()
    assert h.scheduler.retry_after() >= 1.0
    h.run()


def test_retry_after_is_the_time_the_recent_finish_rate_needs_to_drain_the_queue() -> None:
    # One seat and one-token answers: a request finishes every step, and a step takes 0.5 s.
    h = TierHarness(max_num_seqs=1, seconds_per_step=lambda plan: 0.5)
    for k in range(12):
        h.add(f"r{k}", prompt_of(3, k), max_tokens=1)
    for _ in range(3):
        h.step()
    # Finishes at 0.5, 1.0 and 1.5 s: 2 per second; 9 waiting take ceil(9 / 2) = 5 s.
    assert h.scheduler.num_waiting == 9
    assert h.scheduler.retry_after() == 5.0
    h.run()


def test_deadline_expiry_ends_running_and_waiting_requests_and_frees_their_blocks() -> None:
    h = TierHarness(num_blocks=16, max_num_seqs=1)
    h.add("runs", prompt_of(8, 1), max_tokens=50, deadline=1.0)
    h.add("waits", prompt_of(8, 40), max_tokens=5, deadline=0.5)
    h.add("plain", prompt_of(8, 80), max_tokens=3)
    h.step()
    h.step()
    assert len(h.outputs["runs"]) == 2 and h.kv.has_allocation("runs")
    h.clock.now = 0.5
    plan = h.step()
    assert h.finish_reasons["waits"] == FinishReason.TIMEOUT.value and h.outputs["waits"] == []
    assert "waits" in plan.finished_request_ids
    h.clock.now = 1.0
    plan = h.step()
    assert h.finish_reasons["runs"] == "timeout"
    assert not h.kv.has_allocation("runs") and ids(plan) == ["plain"]
    assert h.outputs["runs"] == reference(prompt_of(8, 1), 3)  # what it produced before its deadline
    h.run()
    assert h.finish_reasons["plain"] == "length"
    h.assert_outputs_match_reference()


def test_tier_config_is_validated_at_start_up() -> None:
    cases = [
        ([TierConfig("priority"), TierConfig("flex")], "must include 'default'"),
        ([TierConfig("default"), TierConfig("default")], "must be unique"),
        ([TierConfig("default", step_share=0.0)], "step_share must be in"),
        ([TierConfig("default", ttft_slo=-1.0)], "ttft_slo must be > 0"),
        ([TierConfig("default"), TierConfig("auto")], "'auto' is not a tier"),
    ]
    for tiers, message in cases:
        with pytest.raises(ValueError, match=message):
            EngineConfig(scheduler=SchedulerConfig(tiers=tiers)).validate()
    with pytest.raises(ValueError, match="user weight"):
        SchedulerConfig(user_weights={"x": 0.0}).validate()


# ---------------------------------------------------------------- everything at once, at random


@st.composite
def tiered_workloads(draw):  # type: ignore[no-untyped-def]
    requests = []
    for _ in range(draw(st.integers(1, 8))):
        prompt = draw(st.lists(st.integers(1, 9), min_size=1, max_size=10))
        requests.append(
            {
                "prompt": prompt,
                "max_tokens": draw(st.integers(1, 6)),
                "tier": draw(st.sampled_from(["priority", "default", "flex", "auto"])),
                "priority": draw(st.integers(-1, 1)),
                "user": draw(st.sampled_from(["u1", "u2", "u3"])),
                "arrival": draw(st.integers(0, 5)),
                "deadline": draw(st.one_of(st.none(), st.integers(0, 20))),
            }
        )
    return {
        "num_blocks": draw(st.integers(5, 20)),
        "budget": draw(st.integers(1, 16)),
        "max_num_seqs": draw(st.integers(1, 5)),
        "policy": draw(st.sampled_from(["fcfs", "vtc", "lpm"])),
        "flex_max_running": draw(st.one_of(st.none(), st.integers(1, 2))),
        "priority_ttft": draw(st.sampled_from([None, 0.5, 2.0, 6.0])),
        "max_exclusive_steps": draw(st.integers(0, 2)),
        "requests": requests,
    }


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tiered_workloads())
def test_random_tiered_workloads_keep_every_invariant(workload) -> None:  # type: ignore[no-untyped-def]
    tiers = [
        TierConfig("priority", ttft_slo=workload["priority_ttft"]),
        TierConfig("default"),
        TierConfig("flex", max_running=workload["flex_max_running"]),
    ]
    # Steps of about a second whose cost grows with tokens and sequences, so that with a TTFT target
    # the step-time bound cuts chunks and first tokens get steps of their own.
    h = TierHarness(
        num_blocks=workload["num_blocks"],
        block_size=2,
        budget=workload["budget"],
        max_num_seqs=workload["max_num_seqs"],
        prefix_caching=workload["policy"] == "lpm",
        policy=workload["policy"],
        tiers=tiers,
        max_exclusive_steps=workload["max_exclusive_steps"],
        seconds_per_step=lambda plan: 0.4 + 0.1 * plan.num_tokens + 0.05 * len(plan.scheduled),
    )
    requests = [r for r in workload["requests"] if len(r["prompt"]) + r["max_tokens"] <= h.kv.capacity_tokens]
    for step in range(3000):
        for k, r in enumerate(requests):
            if r["arrival"] == step:
                deadline = None if r["deadline"] is None else float(r["arrival"] + r["deadline"])
                h.add(
                    str(k),
                    r["prompt"],
                    r["max_tokens"],
                    service_tier=r["tier"],
                    priority=r["priority"],
                    user=r["user"],
                    deadline=deadline,
                )
        if step > 5 and not h.scheduler.has_unfinished():
            break
        had_work = h.scheduler.has_unfinished()
        plan = h.step()
        assert not had_work or not plan.is_empty or plan.finished_request_ids, "work but nothing done"
        running = h.scheduler.running
        assert len(running) <= workload["max_num_seqs"]
        if workload["flex_max_running"] is not None:
            assert sum(r.tier == "flex" for r in running) <= workload["flex_max_running"]
    else:
        pytest.fail("the workload never finished")
    h.assert_all_blocks_back()
    h.assert_outputs_match_reference()
    for k, r in enumerate(requests):
        reason = h.finish_reasons[str(k)]
        if reason == "length":
            assert len(h.outputs[str(k)]) == r["max_tokens"]
        else:
            assert reason == "timeout" and r["deadline"] is not None


# ---------------------------------------------------------------- command line


def test_tier_options_parse_into_the_engine_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        [
            "--policy", "vtc",
            "--tier", "priority:max_running=4",
            "--tier", "default",
            "--tier", "flex:step_share=0.25,max_waiting=100",
            "--tier-slo", "priority:ttft=0.5,tpot=0.05",
            "--user-weight", "key:abc=2",
        ]
    )  # fmt: skip
    config = build_engine_config("m", **engine_kwargs(args))
    config.validate()
    # The engine process gets its config as JSON: tiers and weights must survive the trip.
    decoded = msgspec.json.decode(msgspec.json.encode(config), type=EngineConfig)
    assert decoded.scheduler.tiers == [
        TierConfig("priority", max_running=4, ttft_slo=0.5, tpot_slo=0.05),
        TierConfig("default"),
        TierConfig("flex", step_share=0.25, max_waiting=100),
    ]
    assert decoded.scheduler.user_weights == {"key:abc": 2.0} and decoded.scheduler.policy == "vtc"
    defaults = engine_kwargs(parser.parse_args([]))
    assert [t.name for t in defaults["tiers"]] == ["priority", "default", "flex"]
    for parse, bad, message in [
        (parse_tier, "flex:seats=3", "unknown key 'seats'"),
        (parse_tier, "flex:max_running=many", "max_running must be a number"),
        (parse_tier_slo, "priority:ttft", "expected key=value"),
        (parse_tier_slo, "priority:p99=1", "unknown target 'p99'"),
        (parse_user_weight, "alice", "expected USER=WEIGHT"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse(bad)  # type: ignore[operator]
    with pytest.raises(ValueError, match="--tier-slo names tier 'gold'"):
        engine_kwargs(parser.parse_args(["--tier-slo", "gold:ttft=1"]))
