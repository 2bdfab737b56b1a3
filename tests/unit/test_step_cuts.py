"""The server's rule for cutting steps short (``frontend/step_cuts.py``) and its prefix-cache guess."""

from __future__ import annotations

import pytest

from tokenmill.frontend.step_cuts import PrefixEstimate, StepCuts

BLOCK = 4


def tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def test_the_estimate_counts_what_the_engine_would_compute() -> None:
    estimate = PrefixEstimate(BLOCK, capacity_blocks=64)
    prompt = tokens(18)
    assert estimate.observe(None, prompt) == 18  # nothing recorded yet
    # The same prompt again: four full blocks match; like the engine, never the block holding the
    # last token, so 18 - 16 = 2 are left.
    assert estimate.observe(None, prompt) == 2
    # A prompt of exactly four blocks: the engine matches at most 15 tokens, so three blocks.
    assert estimate.observe(None, prompt[:16]) == 4
    # A longer prompt over the same start, then one that differs in its second block.
    assert estimate.observe(None, prompt + tokens(10, 900)) == 28 - 16
    changed = prompt[:5] + [1] + prompt[6:]
    assert estimate.observe(None, changed) == 18 - BLOCK
    # Shorter than a block: nothing to match, all computed.
    assert estimate.observe(None, [7, 8]) == 2


def test_namespaces_never_share_and_answers_extend_the_prefix() -> None:
    estimate = PrefixEstimate(BLOCK, capacity_blocks=64)
    prompt = tokens(12)
    estimate.observe("alice", prompt)
    assert estimate.observe("bob", prompt) == 12
    assert estimate.observe(None, prompt) == 12
    assert estimate.observe("alice", prompt) == 12 - 8
    # The next turn carries the answer too: without it recorded only the prompt's 3 blocks match,
    # with it (as when the first turn finished) 5 blocks of prompt and answer.
    answer = tokens(9, 500)
    next_turn = prompt + answer + tokens(5, 700)
    assert estimate.observe("carol", prompt) == 12
    assert estimate.observe("carol", next_turn) == 26 - 12
    estimate.record("dave", prompt + answer)
    assert estimate.observe("dave", next_turn) == 26 - 20


def test_the_record_keeps_the_most_recent_blocks_within_capacity() -> None:
    estimate = PrefixEstimate(BLOCK, capacity_blocks=6)
    first, second = tokens(13), tokens(13, 300)
    estimate.observe(None, first)  # 3 blocks
    estimate.observe(None, second)  # 3 more: full
    assert len(estimate) == 6
    assert estimate.observe(None, first) == 1  # touched: now the most recent
    estimate.observe(None, tokens(9, 600))  # 2 new blocks evict second's oldest two
    assert len(estimate) == 6
    assert estimate.observe(None, first) == 1
    # second's first block is gone, so nothing of it matches (a prefix needs its first block).
    assert estimate.observe(None, second) == 13
    estimate.clear()
    assert len(estimate) == 0 and estimate.observe(None, first) == 13
    with pytest.raises(ValueError, match="must be positive"):
        PrefixEstimate(0, 10)


def test_short_prefills_and_ttft_tiers_cut_steps() -> None:
    cuts = StepCuts({"priority"}, short_prefill=8, estimate=PrefixEstimate(BLOCK, 64))
    system = tokens(40)
    assert not cuts.on_send("default", system + [1, 2, 3], None)  # cold: 43 tokens to compute
    assert cuts.on_send("default", system + [4, 5, 6], None)  # 40 cached, 3 left
    assert cuts.on_send("priority", tokens(60, 800), None)  # a TTFT tier always cuts
    assert cuts.on_send("default", [9] * 8, None)  # short even when cold
    assert not cuts.on_send("default", system + [4, 5, 6], "salted")  # another namespace: cold
    cuts.on_finish(None, tokens(30, 1000), [tokens(10, 2000)])
    assert cuts.on_send("default", tokens(30, 1000) + tokens(10, 2000) + [7], None)
    cuts.on_cache_reset()
    assert not cuts.on_send("default", system + [4, 5, 6], None)

    # Without a prefix cache every prompt token is computed; 0 turns the length rule off.
    no_cache = StepCuts(set(), short_prefill=8, estimate=None)
    assert no_cache.on_send("default", [1] * 8, None) and not no_cache.on_send("default", [1] * 9, None)
    no_cache.on_finish(None, [1] * 9, [[2]])  # nothing to record; no error
    off = StepCuts(set(), short_prefill=0, estimate=PrefixEstimate(BLOCK, 64))
    assert not off.on_send("default", [1, 2], None)
