"""Waiting-queue policies: FCFS order and longest-prefix-match ranking over the real radix cache."""

from __future__ import annotations

import pytest

from tokenmill.config import SchedulerConfig
from tokenmill.core.kv.manager import KVCacheManager
from tokenmill.core.policy import make_policy
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.step_io import ModelRunnerOutput
from tokenmill.protocol import EngineCoreRequest
from tokenmill.sampling_params import SamplingParams

BLOCK = 4


def make_request(request_id: str, prompt: list[int], max_tokens: int = 2) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(
        EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params), 256
    )


def run_to_completion(scheduler: Scheduler) -> list[str]:
    """Drive the scheduler with a fake model that always samples token 7; returns admission order."""
    admitted: list[str] = []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        for entry in plan.scheduled:
            if entry.request_id not in admitted:
                admitted.append(entry.request_id)
        result = ModelRunnerOutput(sampled_token_ids={e.request_id: 7 for e in plan.scheduled if e.sample})
        scheduler.update(plan, result)
    return admitted


def test_unknown_policy_names_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown scheduling policy 'nope'.*fcfs.*lpm"):
        make_policy("nope")


def test_lpm_needs_the_prefix_cache() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="lpm policy needs the prefix cache"):
        Scheduler(SchedulerConfig(policy="lpm"), kv, max_model_len=256)


def test_peek_prefix_changes_nothing_and_counts_whole_blocks() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK)
    scheduler = Scheduler(SchedulerConfig(), kv, max_model_len=256)
    shared = list(range(1, 13))  # three full blocks
    scheduler.add_request(make_request("warm", shared + [50]))
    run_to_completion(scheduler)
    cached = kv.radix.cached_blocks
    probe = make_request("probe", shared[:10] + [99, 98, 97])
    assert kv.peek_prefix_tokens(probe) == 8  # blocks 0 and 1 match; block 2 diverges
    assert kv.radix.cached_blocks == cached
    kv.radix.check_integrity()


def test_peek_prefix_answers_again_after_the_tree_changes() -> None:
    # The answer is remembered per request and tree version: inserts, evictions and resets change it.
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK)
    scheduler = Scheduler(SchedulerConfig(), kv, max_model_len=256)
    shared = list(range(1, 13))  # three full blocks
    probe = make_request("probe", shared + [99])
    assert kv.peek_prefix_tokens(probe) == 0
    scheduler.add_request(make_request("warm", shared + [50]))
    run_to_completion(scheduler)
    assert kv.peek_prefix_tokens(probe) == 12
    kv.radix.evict(1)  # the warm request's path is one leaf: all of it goes
    assert kv.peek_prefix_tokens(probe) == 0
    scheduler.add_request(make_request("half", shared[:8] + [60, 61]))
    run_to_completion(scheduler)
    assert kv.peek_prefix_tokens(probe) == 8
    assert kv.reset_prefix_cache()
    assert kv.peek_prefix_tokens(probe) == 0


def test_lpm_admits_the_longest_cached_prefix_first() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK)
    config = SchedulerConfig(policy="lpm", max_num_seqs=1, max_num_batched_tokens=64)
    scheduler = Scheduler(config, kv, max_model_len=256)
    hot = list(range(1, 17))  # four full blocks
    scheduler.add_request(make_request("warm", hot + [60]))
    run_to_completion(scheduler)

    scheduler.add_request(make_request("cold", [90 + i for i in range(17)]))
    scheduler.add_request(make_request("half", hot[:8] + [70 + i for i in range(9)]))
    scheduler.add_request(make_request("full", hot + [80]))
    assert run_to_completion(scheduler) == ["full", "half", "cold"]
    assert kv.all_free_or_cached()
    kv.check_integrity()


def test_fcfs_keeps_arrival_order() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1), kv, max_model_len=256)
    hot = list(range(1, 17))
    scheduler.add_request(make_request("warm", hot + [60]))
    run_to_completion(scheduler)
    scheduler.add_request(make_request("cold", [90 + i for i in range(17)]))
    scheduler.add_request(make_request("full", hot + [80]))
    assert run_to_completion(scheduler) == ["cold", "full"]


def test_lpm_serves_the_largest_group_of_a_new_prefix_first() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK)
    config = SchedulerConfig(policy="lpm", max_num_seqs=1, max_num_batched_tokens=64)
    scheduler = Scheduler(config, kv, max_model_len=256)
    prefixes = {"a": list(range(1, 17)), "b": list(range(20, 36)), "c": list(range(40, 56))}  # 4 blocks
    for request_id in ["a1", "c1", "b1", "b2", "b3"]:
        tail = [60 + 5 * int(request_id[1]) + i for i in range(5)]
        scheduler.add_request(make_request(request_id, prefixes[request_id[0]] + tail))
    # Nothing is cached: b's three requests share their first blocks, so b1 goes first and b2, b3
    # then match them; a1 and c1 (alone in their groups) follow in arrival order.
    assert run_to_completion(scheduler) == ["b1", "b2", "b3", "a1", "c1"]
    assert kv.prefix_hit_tokens == 2 * 16
    assert kv.all_free_or_cached()
    kv.check_integrity()


def test_lpm_puts_a_started_prompt_back_only_when_the_burst_gains_more_than_the_lost_work() -> None:
    policy = make_policy("lpm", prefix_length=lambda request: 0)  # nothing cached
    prefix_of = {group: [100 * group + i for i in range(16)] for group in range(1, 9)}

    def member(group: int, index: int) -> Request:
        return make_request(
            f"g{group}-{index}", prefix_of[group] + [1000 + 8 * group + index] * 4
        )  # 20 tokens

    started = [member(1, 0)]  # a prompt alone in its group; its step is paused
    burst = [member(2, i) for i in range(4)]
    for request in burst:
        policy.add(request)
    # Going on costs the four of the burst 3/4 of the started step each; putting it back costs the
    # started prompt the burst's first step and what it ran. Early on, the burst goes first.
    assert policy.outranks(started, fraction_done=0.05)
    assert not policy.outranks(started, fraction_done=0.7)
    # Eleven unrelated prompts wait too: each would wait through the lost work as well.
    for group in range(3, 9):
        for index in range(2 if group < 8 else 1):
            policy.add(member(group, index))
    assert policy.outranks(started, fraction_done=0.05)
    assert not policy.outranks(started, fraction_done=0.3)
    # The started prompt's own group waiting behind it weighs for going on (it would wait as long).
    policy.add(member(1, 1))
    policy.add(member(1, 2))
    assert policy.outranks(started, fraction_done=0.0)
    assert not policy.outranks(started, fraction_done=0.1)
    # A first-ranked started request is never put back; nor is anything without a fresh waiting one.
    assert not policy.outranks([member(2, 9)], fraction_done=0.0)
    assert not make_policy("lpm", prefix_length=lambda request: 0).outranks(started, fraction_done=0.0)
    assert not make_policy("fcfs").outranks(started, fraction_done=0.0)
