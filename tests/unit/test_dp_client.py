"""``DPClient`` (``core/dp_client.py``) over real engine cores of a tiny model, in this process: the
same outputs as one engine, requests spread by the policy and kept together by prefix, aborts reach
the right engine and free its blocks, utility calls fan out, one engine's death is the client's."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tokenmill.config import build_engine_config
from tokenmill.core.client import EngineDeadError, InProcClient, UtilityCallError
from tokenmill.core.dp_client import DPClient
from tokenmill.core.engine_core import EngineCore
from tokenmill.loader import resolve_model
from tokenmill.protocol import AddResult, EngineCoreOutputs, EngineCoreRequest
from tokenmill.router.policy import DispatchPolicy
from tokenmill.sampling_params import SamplingParams

BLOCK = 4
SYSTEM_A = [7, 21, 33, 40, 52, 61, 70, 88, 93, 11, 12, 13]
SYSTEM_B = [5, 6, 8, 9, 14, 15, 16, 17, 18, 19, 22, 23]


class SteppingClient(InProcClient):
    """An in-process engine whose ``get_outputs`` waits for work (as an engine process's would) and
    then runs one step, so a ``DPClient`` can pump several in one event loop."""

    def __init__(self, core: EngineCore) -> None:
        super().__init__(core)
        self.work = asyncio.Event()
        self.dead: str | None = None

    @property
    def is_alive(self) -> bool:
        return self.dead is None

    @property
    def dead_reason(self) -> str | None:
        return self.dead

    async def add_request_group(
        self, requests: list[EngineCoreRequest], *, cut_step: bool = False
    ) -> AddResult:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        result = await super().add_request_group(requests)
        self.work.set()
        return result

    async def get_outputs(self) -> EngineCoreOutputs:
        while not self.core.has_unfinished_requests():
            if self.dead is not None:
                raise EngineDeadError(self.dead)
            self.work.clear()
            await self.work.wait()
        await asyncio.sleep(0)  # let the other engines' tasks run between steps
        return self.core.step()

    def die(self, reason: str) -> None:
        self.dead = reason
        self.work.set()


@pytest.fixture(scope="module")
def cores(tiny_model) -> Iterator[list[EngineCore]]:  # type: ignore[no-untyped-def]
    path = tiny_model("llama").path
    # As a replica's config is (core/dp_spawn.py): its cache events feed the client's index.
    config = build_engine_config(
        path, dtype="float32", block_size=BLOCK, num_blocks=64, publish_kv_events=True
    )
    built = [EngineCore(config, resolve_model(path)) for _ in range(3)]
    yield built
    for core in built:
        core.shutdown()


def request(request_id: str, prompt: list[int], max_tokens: int = 4) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params)


async def run_all(client: DPClient, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Send every prompt, collect every request's tokens until each has finished."""
    for request_id, prompt in prompts.items():
        result = await client.add_request_group([request(request_id, prompt)])
        assert result.error is None
    tokens: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    done: set[str] = set()
    while len(done) < len(prompts):
        batch = await client.get_outputs()
        for output in batch.outputs:
            tokens[output.request_id] += output.new_token_ids
            if output.finish_reason is not None:
                done.add(output.request_id)
    return tokens


def dp_client(cores: list[EngineCore], policy: str, **kwargs: float) -> DPClient:
    for core in cores:
        assert core.reset_prefix_cache()
    return DPClient([SteppingClient(core) for core in cores], DispatchPolicy(policy, **kwargs))  # type: ignore[arg-type]


def assert_all_free(cores: list[EngineCore]) -> None:
    for core in cores:
        stats = core.kv_stats()
        assert stats["blocks_in_use"] == 0 and stats["all_free_or_cached"], stats
        assert not core.has_unfinished_requests()


PROMPTS = {
    "a1": [*SYSTEM_A, 1, 2, 3],
    "b1": [*SYSTEM_B, 4, 5],
    "a2": [*SYSTEM_A, 9, 8, 7, 6, 5],
    "b2": [*SYSTEM_B, 3],
    "c": [30, 31, 32],
}


def test_outputs_equal_one_engine_and_round_robin_uses_both(cores: list[EngineCore]) -> None:
    async def go() -> tuple[dict[str, list[int]], dict[str, list[int]], list[int]]:
        single = dp_client(cores[:1], "round_robin")
        one = await run_all(single, PROMPTS)
        await single.shutdown()
        pair = dp_client(cores[1:], "round_robin")
        two = await run_all(pair, PROMPTS)
        dispatched = [s.dispatched for s in pair.replica_stats()]
        assert pair.policy.loads == {"0": 0, "1": 0}
        assert not pair._owner  # every request's end was seen
        await pair.shutdown()
        return one, two, dispatched

    one, two, dispatched = asyncio.run(go())
    assert two == one and all(len(t) == 4 for t in one.values())
    assert dispatched == [3, 2]
    assert_all_free(cores)


def test_cache_aware_keeps_a_prefix_on_one_engine(cores: list[EngineCore]) -> None:
    async def go() -> None:
        client = dp_client(cores[:2], "cache_aware")
        seen: dict[str, str] = {}
        for request_id, prompt in PROMPTS.items():
            decision_before = [s.dispatched for s in client.replica_stats()]
            await run_all(client, {request_id: prompt})
            after = [s.dispatched for s in client.replica_stats()]
            seen[request_id] = str([b - a for a, b in zip(decision_before, after, strict=True)].index(1))
        stats = client.replica_stats()
        await client.shutdown()
        assert seen["a1"] != seen["b1"]
        assert seen["a2"] == seen["a1"] and seen["b2"] == seen["b1"]
        # a2 and b2 found their system prompt (3 whole blocks) cached where they were sent, as the
        # dispatch index predicted.
        assert [s.cached_prompt_tokens for s in stats] == [len(SYSTEM_A), len(SYSTEM_B)]
        assert [s.predicted_hit_tokens for s in stats] == [len(SYSTEM_A), len(SYSTEM_B)]

    asyncio.run(go())
    assert_all_free(cores)


def test_abort_reaches_the_owner_and_frees_its_blocks(cores: list[EngineCore]) -> None:
    async def go() -> None:
        client = dp_client(cores[:2], "round_robin")
        for request_id in ("x", "y"):
            added = await client.add_request_group([request(request_id, SYSTEM_A, max_tokens=50)])
            assert added.error is None
        await client.get_outputs()
        assert client.policy.loads == {"0": 1, "1": 1}
        client.abort_requests(["y", "unknown"])
        assert client.policy.loads == {"0": 1, "1": 0}
        client.abort_requests(["x"])
        assert client.policy.loads == {"0": 0, "1": 0}
        for core in cores[:2]:
            core.step()  # the engines finish what was aborted between steps
        await client.shutdown()

    asyncio.run(go())
    assert_all_free(cores)


def test_utility_calls_fan_out(cores: list[EngineCore]) -> None:
    async def go() -> None:
        client = dp_client(cores[:2], "cache_aware")
        await run_all(client, {"a": PROMPTS["a1"], "b": PROMPTS["b1"]})
        stats = await client.call_utility("kv_stats")
        one = cores[0].kv_stats()
        assert stats["data_parallel_size"] == 2
        assert stats["num_blocks"] == 2 * int(one["num_blocks"])  # type: ignore[arg-type]
        assert stats["block_size"] == BLOCK
        assert stats["cached_blocks"] == sum(int(c.kv_stats()["cached_blocks"]) for c in cores[:2])  # type: ignore[arg-type]
        assert client.policy.choose(client_key(client, PROMPTS["a1"])).matched_chunks > 0
        assert await client.call_utility("reset_prefix_cache") == {"success": True}
        assert client.policy.choose(client_key(client, PROMPTS["a1"])).matched_chunks == 0
        assert all(c.kv_stats()["cached_blocks"] == 0 for c in cores[:2])
        with pytest.raises(UtilityCallError, match="not supported with data parallelism"):
            await client.call_utility("init_weights_update_group", {})
        with pytest.raises(
            UtilityCallError, match="data-parallel engine 0: ValueError: unknown engine method"
        ):
            await client.call_utility("no_such_method")
        await client.shutdown()

    asyncio.run(go())


def client_key(client: DPClient, prompt: list[int]):  # type: ignore[no-untyped-def]
    from tokenmill.core.kv.kv_events import block_hashes
    from tokenmill.router.policy import PromptKey

    return PromptKey(block_hashes((None, None), prompt, client.block_size))


def test_one_engine_dying_is_the_clients_death(cores: list[EngineCore]) -> None:
    async def go() -> None:
        engines = [SteppingClient(core) for core in cores[:2]]
        client = DPClient(engines, DispatchPolicy("round_robin"))  # type: ignore[arg-type]
        assert (await client.add_request_group([request("p", SYSTEM_A, max_tokens=50)])).error is None
        engines[1].die("the engine process exited (code 9)")
        with pytest.raises(EngineDeadError, match="data-parallel engine 1: the engine process exited"):
            while True:
                await client.get_outputs()
        assert not client.is_alive
        with pytest.raises(EngineDeadError, match="data-parallel engine 1"):
            await client.add_request_group([request("q", SYSTEM_B)])
        with pytest.raises(EngineDeadError):
            await client.call_utility("kv_stats")
        client.abort_requests(["p"])
        cores[0].step()
        await client.shutdown()

    asyncio.run(go())
    assert_all_free(cores)
