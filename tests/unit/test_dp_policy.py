"""Dispatch policies and the approximate prefix index (``router/policy.py``, ``router/prefix_index.py``),
shared by the data-parallel client and the HTTP router: pure logic, no engine."""

from __future__ import annotations

import pytest

from tokenmill.router.policy import DispatchPolicy, PromptKey
from tokenmill.router.prefix_index import ReplicaPrefixes, chunk_hashes

BLOCK = 4


def key(tokens: list[int], namespace: object = None) -> PromptKey:
    return PromptKey.of(namespace, tokens, BLOCK)


def policy(name: str, replicas: int = 2, capacity: int = 1000, **kwargs: float) -> DispatchPolicy:
    chosen = DispatchPolicy(name, **kwargs)  # type: ignore[arg-type]
    for rank in range(replicas):
        chosen.add_replica(str(rank), capacity)
    return chosen


def test_chunk_hashes_name_whole_prefixes_under_a_namespace() -> None:
    a = chunk_hashes("ns", list(range(10)), BLOCK)
    assert len(a) == 2  # the partial last chunk (tokens 8, 9) is not hashed
    b = chunk_hashes("ns", [*range(8), 50, 51, 52, 53], BLOCK)
    assert b[:2] == a and len(b) == 3
    assert chunk_hashes("other", list(range(10)), BLOCK)[0] != a[0]
    # A chunk's hash depends on everything before it, not only on its own tokens.
    assert chunk_hashes("ns", [9, 9, 9, 9, 4, 5, 6, 7], BLOCK)[1] != a[1]
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        chunk_hashes("ns", [1], 0)


def test_replica_prefixes_evict_a_prompt_tail_before_its_head() -> None:
    index = ReplicaPrefixes(capacity=4)
    first = chunk_hashes(None, list(range(12)), BLOCK)  # 3 chunks
    index.insert(first)
    assert index.match(first) == 3
    second = chunk_hashes(None, list(range(100, 108)), BLOCK)  # 2 more: one chunk must go
    index.insert(second)
    assert len(index) == 4
    assert index.match(second) == 2
    assert index.match(first) == 2  # the deepest chunk went, the head stays matchable
    index.clear()
    assert index.match(first) == 0
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        ReplicaPrefixes(0)


def test_round_robin_goes_in_turn_and_least_load_to_the_idlest() -> None:
    turns = policy("round_robin", replicas=3)
    assert [turns.choose(key([1] * 8)).replica for _ in range(6)] == ["0", "1", "2", "0", "1", "2"]
    least = policy("least_load", replicas=3)
    least.on_dispatch("0", key([1] * 8), 2)
    least.on_dispatch("1", key([1] * 8), 1)
    assert least.choose(key([1] * 8)).replica == "2"
    least.on_dispatch("2", key([1] * 8), 3)
    decision = least.choose(key([1] * 8))
    assert (decision.replica, decision.reason) == ("1", "least_load")


def test_cache_aware_sends_a_prefix_where_it_was_sent_before() -> None:
    chooser = policy("cache_aware", replicas=2)
    system_a = list(range(16))
    system_b = list(range(200, 216))
    first = chooser.choose(key([*system_a, 1, 2, 3, 4]))
    assert first.reason == "new_prefix" and first.matched_chunks == 0
    chooser.on_dispatch(first.replica, key([*system_a, 1, 2, 3, 4]))
    # A new prefix goes to the other, idle replica; then each prefix sticks to its replica.
    other = chooser.choose(key([*system_b, 5, 6, 7, 8]))
    assert other.replica != first.replica
    chooser.on_dispatch(other.replica, key([*system_b, 5, 6, 7, 8]))
    again = chooser.choose(key([*system_a, 9, 9, 9, 9]))
    assert (again.replica, again.matched_chunks, again.reason) == (first.replica, 4, "prefix")
    # Even when that replica is a little busier: within the thresholds the prefix wins.
    chooser.on_dispatch(first.replica, key(system_a), 5)
    assert chooser.choose(key(system_a)).replica == first.replica
    # Another namespace (cache salt, adapter) shares nothing.
    assert chooser.choose(key(system_a, namespace="salt")).matched_chunks == 0


def test_cache_aware_balances_only_beyond_both_thresholds() -> None:
    chooser = policy("cache_aware", replicas=2, balance_abs=4, balance_rel=2.0)
    prompt = key(list(range(16)))
    chooser.on_dispatch("0", prompt, 5)  # loads 5 / 0: differ by 5 > 4 and 5 > 2 * 0
    decision = chooser.choose(prompt)
    assert (decision.replica, decision.reason) == ("1", "balance")
    chooser.on_dispatch("1", key([7] * 8), 2)  # 5 / 2: differ by 3, not beyond balance_abs
    assert chooser.choose(prompt).replica == "0"
    chooser.on_dispatch("0", prompt, 4)  # 9 / 2: beyond both
    assert chooser.choose(prompt).reason == "balance"
    chooser.on_dispatch("1", key([7] * 8), 3)  # 9 / 5: by 4 only, and 9 < 2 * 5
    assert chooser.choose(prompt).replica == "0"
    chooser.on_finish("0", 9)
    assert chooser.loads == {"0": 0, "1": 5}


def test_ties_go_to_the_least_loaded_then_the_emptiest_index() -> None:
    chooser = policy("cache_aware", replicas=2)
    shared = key(list(range(8)))
    chooser.on_dispatch("0", shared)
    chooser.on_dispatch("1", shared)
    chooser.on_finish("0")
    chooser.on_finish("1")
    chooser.on_dispatch("1", key(list(range(50, 62))), 0)  # replica 1's index holds more
    chooser.on_dispatch("0", key([3] * 8), 1)
    assert chooser.choose(shared).replica == "1"  # both hold the prefix; 0 is busier
    # Nobody holds this one: it goes to the replica whose index holds less, even if busier.
    assert chooser.choose(key([99] * 8)).replica == "0"


def test_membership_changes_and_bad_arguments() -> None:
    chooser = policy("cache_aware", replicas=2)
    prompt = key(list(range(8)))
    chooser.on_dispatch("0", prompt)
    chooser.remove_replica("0")
    assert chooser.replicas == ["1"]
    assert chooser.choose(prompt).replica == "1"
    chooser.add_replica("0", 100)  # back with an empty index
    assert chooser.choose(prompt, available=["0"]).matched_chunks == 0
    chooser.on_dispatch("1", prompt)
    chooser.clear_prefixes("1")
    assert chooser.choose(prompt, available=["1"]).matched_chunks == 0
    with pytest.raises(ValueError, match="no replica is available"):
        chooser.choose(prompt, available=["7"])
    with pytest.raises(ValueError, match="must be one of cache_aware, round_robin, least_load"):
        DispatchPolicy("random")
    with pytest.raises(ValueError, match="balance_rel must be >= 1.0"):
        DispatchPolicy("cache_aware", balance_rel=0.5)


def test_the_router_keys_requests_on_their_text() -> None:
    from tokenmill.router.app import CHARS_PER_CHUNK, prompt_key

    system = {"role": "system", "content": "You are a helpful assistant who answers briefly. " * 2}
    first = prompt_key(
        "/v1/chat/completions", {"model": "m", "messages": [system, {"role": "user", "content": "a"}]}
    )
    second = prompt_key(
        "/v1/chat/completions", {"model": "m", "messages": [system, {"role": "user", "content": "b"}]}
    )
    shared = sum(1 for a, b in zip(first.hashes, second.hashes, strict=False) if a == b)
    assert shared >= len(system["content"]) // CHARS_PER_CHUNK  # the system message's chunks are shared
    assert first.hashes != second.hashes
    other_model = prompt_key("/v1/chat/completions", {"model": "n", "messages": [system]})
    assert other_model.hashes[0] != first.hashes[0]
    text = "x" * 40
    assert (
        prompt_key("/v1/completions", {"prompt": text}).hashes
        == prompt_key("/v1/completions", {"prompt": [text]}).hashes
    )
    assert len(prompt_key("/generate", {"input_ids": list(range(40))}).hashes) == 40 // CHARS_PER_CHUNK
    assert prompt_key("/v1/completions", {"prompt": 5}).hashes == []  # not a prompt: no key, least loaded
