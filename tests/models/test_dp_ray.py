"""Data-parallel replicas as Ray actors (``data_parallel_backend="ray"``, ``core/dp_ray.py``) on a
local Ray cluster of two CPUs: two replica actors, each in its own placement group, served by the
``DPClient`` over ZMQ tcp. Greedy tokens equal one in-process engine's, both replicas serve, their
cache events reach the client's index, and a killed actor is an engine fault, never a hang."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tests.conftest import TinyModel
from tests.unit.test_dp_client import PROMPTS, request, run_all
from tokenmill.config import build_engine_config
from tokenmill.core.client import EngineDeadError
from tokenmill.core.dp_client import DPClient, DPLaunch
from tokenmill.core.engine_core import EngineCore
from tokenmill.loader import resolve_model

ray = pytest.importorskip("ray", reason="Ray is the optional extra tokenmill[ray] (make install adds it)")


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
    yield
    ray.shutdown()


def config(llama: TinyModel, **overrides: object):  # type: ignore[no-untyped-def]
    settings: dict[str, object] = {"dtype": "float32", "block_size": 4, "num_blocks": 64, "num_threads": 1}
    return build_engine_config(llama.path, **{**settings, **overrides})


def expected_tokens(llama: TinyModel) -> dict[str, list[int]]:
    core = EngineCore(config(llama), resolve_model(llama.path))
    tokens: dict[str, list[int]] = {}
    try:
        for request_id, prompt in PROMPTS.items():
            core.add_request(request(request_id, prompt))
            while core.has_unfinished_requests():
                for output in core.step().outputs:
                    tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    finally:
        core.shutdown()
    return tokens


def test_two_ray_replicas_equal_one_engine_and_die_loudly(local_ray: None, tiny_model) -> None:  # type: ignore[no-untyped-def]
    llama: TinyModel = tiny_model("llama")
    expected = expected_tokens(llama)
    dp_config = config(llama, data_parallel_size=2, data_parallel_backend="ray")

    async def go() -> None:
        launch = DPLaunch.begin(dp_config, log_level="WARNING")
        try:
            client: DPClient = await launch.wait_ready(300)
        except BaseException:
            launch.abandon()
            raise
        try:
            groups = ray.util.placement_group_table().values()
            assert sum(group["state"] == "CREATED" for group in groups) == 2  # one group per replica
            got = await run_all(client, PROMPTS)
            assert got == expected
            assert all(s.dispatched > 0 for s in client.replica_stats())
            # The replicas' own cache events reached the index (nothing is pending any more).
            assert all(index.held for index in client.indexes) and not client._pending
            first = await client.add_request_group([request("long", PROMPTS["a1"], max_tokens=200)])
            assert first.error is None
            ray.kill(launch.launches[client._owner["long"]].handle.process._actor, no_restart=True)  # type: ignore[attr-defined]

            async def drain() -> None:
                while True:
                    await client.get_outputs()

            with pytest.raises(EngineDeadError, match="data-parallel engine"):
                await asyncio.wait_for(drain(), timeout=60)
            assert not client.is_alive
            with pytest.raises(EngineDeadError):
                await client.add_request_group([request("after", PROMPTS["c"])])
        finally:
            await asyncio.wait_for(client.shutdown(timeout=10), timeout=60)

    asyncio.run(go())
    assert all(group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())
