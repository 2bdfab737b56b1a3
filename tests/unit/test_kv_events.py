"""KV cache events (``core/kv/kv_events.py``) feeding a data-parallel client's prefix index: the
index equals what each replica's radix tree holds, through splits, evictions and resets, and
``cache_aware`` dispatch follows the caches' real contents after evictions."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Iterator

import msgspec
import pytest

from tests.unit.test_dp_client import SteppingClient, assert_all_free, request, run_all
from tokenmill.config import build_engine_config
from tokenmill.core.dp_client import DPClient
from tokenmill.core.engine_core import EngineCore
from tokenmill.core.kv.kv_events import KVEventCollector, block_hashes
from tokenmill.core.kv.pool import BlockPool
from tokenmill.core.kv.radix import RadixCache
from tokenmill.loader import resolve_model
from tokenmill.protocol import EngineCoreOutputs, KVEvent
from tokenmill.router.policy import DispatchPolicy, PromptKey
from tokenmill.router.prefix_index import EventFedPrefixes


def tree_hashes(radix: RadixCache, to_frontend) -> set[int]:  # type: ignore[no-untyped-def]
    """Every block hash the tree holds, computed from its nodes' whole paths."""
    held: set[int] = set()
    for namespace, root in radix._roots.items():
        stack = [(child, child.tokens) for child in root.children.values()]
        while stack:
            node, path = stack.pop()
            held.update(block_hashes(to_frontend(namespace), path, radix.block_size))
            stack.extend((child, path + child.tokens) for child in node.children.values())
    return held


def salt_only(namespace: Hashable) -> tuple[str | None, str | None]:
    return (namespace if isinstance(namespace, str) else None, None)


def test_events_track_the_tree_through_splits_evictions_and_reset() -> None:
    pool = BlockPool(16)
    radix = RadixCache(pool, 2)
    collector = KVEventCollector(2, salt_only)
    radix.observer = collector
    index = EventFedPrefixes(16)

    def insert(namespace: str | None, tokens: list[int]) -> None:
        blocks = pool.allocate(len(tokens) // 2)
        radix.insert(namespace, tokens, blocks)
        pool.free(blocks)  # the tree keeps its own reference

    def check() -> None:
        for event in collector.drain():
            # Events cross processes as msgpack: check they survive it.
            event = msgspec.msgpack.decode(msgspec.msgpack.encode(event), type=KVEvent)
            index.apply(event.kind, event.block_hashes)
        assert set(index.held) == tree_hashes(radix, salt_only)
        assert all(count == 1 for count in index.held.values())

    insert(None, [1, 2, 3, 4, 5, 6])
    check()
    insert(None, [1, 2, 3, 4, 9, 9])  # splits the first edge after 2 blocks
    check()
    insert("user", [1, 2, 3, 4])  # the same tokens under another salt hash apart
    check()
    assert len(index.held) == 6
    radix.match_prefix(None, [1, 2, 3, 4, 9, 9])  # the [9, 9] leaf is now the newest
    assert radix.evict(1) == 1  # the oldest leaf: [5, 6]
    check()
    assert index.match(block_hashes((None, None), [1, 2, 3, 4, 5, 6], 2)) == 2
    assert index.match(block_hashes((None, None), [1, 2, 3, 4, 9, 9], 2)) == 3
    radix.evict(16)
    check()
    assert not index.held
    insert(None, [7, 7, 8, 8])
    radix.reset()
    check()
    assert not index.held
    radix.check_integrity()


def test_pending_guesses_count_until_settled() -> None:
    index = EventFedPrefixes(4)
    hashes = block_hashes((None, None), [1, 2, 3, 4, 5, 6], 2)
    index.insert(hashes)
    assert index.match(hashes) == 3 and len(index) == 3
    index.apply("stored", hashes[:2])  # the replica cached two blocks of it
    index.settle(hashes)
    assert index.match(hashes) == 2 and len(index) == 2
    with pytest.raises(ValueError, match="unknown KV cache event 'moved'"):
        index.apply("moved", hashes)


BLOCK = 4
SYSTEMS = [[20 * g + k for k in range(20)] for g in range(6)]  # 6 system prompts, 5 blocks each


@pytest.fixture(scope="module")
def small_cores(tiny_model) -> Iterator[list[EngineCore]]:  # type: ignore[no-untyped-def]
    path = tiny_model("llama").path
    # 12 blocks each: two prompts' paths, so later prompts evict earlier ones.
    config = build_engine_config(
        path, dtype="float32", block_size=BLOCK, num_blocks=12, publish_kv_events=True
    )
    built = [EngineCore(config, resolve_model(path)) for _ in range(2)]
    yield built
    for core in built:
        core.shutdown()


def test_index_equals_the_replicas_trees_and_dispatch_follows_them(small_cores: list[EngineCore]) -> None:
    for core in small_cores:
        assert core.reset_prefix_cache()
        core.drain_kv_events()

    def frontend(namespace: Hashable) -> tuple[str | None, str | None]:
        return (None, None)

    async def go() -> None:
        client = DPClient([SteppingClient(core) for core in small_cores], DispatchPolicy("cache_aware"))  # type: ignore[arg-type]
        for round_ in range(2):
            for group, system in enumerate(SYSTEMS):
                await run_all(client, {f"r{round_}-{group}": [*system, 150 + group, 151]})
        for rank, core in enumerate(small_cores):
            index = client.indexes[rank]
            assert set(index.held) == tree_hashes(core.kv_manager.radix, frontend)
            assert index.match(block_hashes((None, None), [1] * 8, BLOCK)) == 0
        assert not client._pending  # every dispatch was settled
        evicted = 0
        for system in SYSTEMS:
            prompt = [*system, 99]
            real = [core.kv_manager.radix.peek_prefix_blocks((None, 0, None), prompt) for core in small_cores]
            key = PromptKey(block_hashes((None, None), prompt, BLOCK))
            decision = client.policy.choose(key)
            # The index knows exactly what each replica holds, and dispatch goes where most is.
            assert [client.indexes[r].match(key.hashes) for r in range(2)] == real
            assert decision.matched_chunks == max(real)
            if max(real) > 0:
                assert real[int(decision.replica)] == max(real) and decision.reason == "prefix"
            else:
                assert decision.reason == "new_prefix"
            evicted += max(real) < len(system) // BLOCK
        # The caches could not hold all six system prompts: some lost blocks everywhere (a
        # dispatch-fed index would still believe them whole), and dispatch knows it.
        assert evicted > 0
        await client.shutdown()

    asyncio.run(go())
    assert_all_free(small_cores)


def test_engine_core_reports_events_in_its_outputs(small_cores: list[EngineCore]) -> None:
    core = small_cores[0]
    assert core.reset_prefix_cache()
    core.drain_kv_events()
    core.add_request(request("e", [*SYSTEMS[0], 1], max_tokens=1))
    stored: list[int] = []
    while core.has_unfinished_requests():
        outputs: EngineCoreOutputs = core.step()
        stored += [h for e in outputs.kv_events if e.kind == "stored" for h in e.block_hashes]
    expected = block_hashes((None, None), SYSTEMS[0], BLOCK)
    assert len(expected) == 5 and stored[: len(expected)] == expected
