"""Tensor-parallel ranks as Ray actors (``distributed_executor_backend="ray"``) on a local Ray cluster
of two CPUs: both actors in one STRICT_PACK placement group on this (the engine's) node, gloo between
them. The tiny Llama gives the single-process engine's tokens, with chunked prefill, the prefix cache
and seeded n = 2; an actor that dies is an engine fault, never a hang."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import pytest

from tests.conftest import TinyModel
from tests.models.test_tensor_parallel import generate_mixed
from tests.unit.test_first_token_pass import request, tiny_llm
from tokenmill import LLM
from tokenmill.config import build_engine_config
from tokenmill.core.engine_core import EngineCore
from tokenmill.executor.rank_group import WorkerProcessError
from tokenmill.loader import resolve_model

ray = pytest.importorskip("ray", reason="Ray is the optional extra tokenmill[ray] (make install adds it)")


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def llama(tiny_model) -> TinyModel:  # type: ignore[no-untyped-def]
    return tiny_model("llama")


def test_two_actor_ranks_equal_one_process(local_ray: None, llama: TinyModel) -> None:
    from tokenmill.executor.ray_executor import RayExecutor

    settings: dict[str, object] = {"max_num_batched_tokens": 16, "enable_prefix_caching": True}
    expected = generate_mixed(tiny_llm(llama, num_threads=1, **settings))
    llm = tiny_llm(
        llama,
        tensor_parallel_size=2,
        num_threads=2,
        distributed_executor_backend="ray",
        first_token_pass=False,
        **settings,
    )
    executor = llm.engine.executor
    try:
        assert isinstance(executor, RayExecutor)
        here = ray.get_runtime_context().get_node_id()
        assert executor.node_ids == [here, here]  # rank 0 on the engine's node, STRICT_PACK
        assert generate_mixed(llm) == expected
        assert llm.engine.kv_manager.prefix_hit_tokens > 0
        assert llm.engine.kv_manager.all_free_or_cached()
    finally:
        executor.shutdown()
    assert ray.util.placement_group_table() and all(
        group["state"] == "REMOVED" for group in ray.util.placement_group_table().values()
    )


def test_a_dead_actor_is_an_engine_fault_not_a_hang(local_ray: None, llama: TinyModel) -> None:
    config = build_engine_config(
        llama.path,
        dtype="float32",
        num_blocks=16,
        tensor_parallel_size=2,
        num_threads=2,
        distributed_executor_backend="ray",
    )
    core = EngineCore(config, resolve_model(llama.path))
    executor = core.executor
    core.add_request(request("a", [5, 6, 7], 2))
    core.step()
    ray.kill(executor.actors[1], no_restart=True)  # type: ignore[attr-defined]
    core.add_request(request("b", [8, 9, 10], 2))
    started = time.monotonic()
    with pytest.raises(WorkerProcessError, match="rank 1 .*a Ray actor.* died while running a step"):
        while True:
            core.step()
    with pytest.raises(WorkerProcessError, match="died"):
        core.step()  # stays failed
    assert time.monotonic() - started < 60


def test_without_ray_the_backend_is_a_clear_error(llama: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(ValueError, match=r"needs Ray: pip install 'tokenmill\[ray\]'"):
        LLM(llama.path, tensor_parallel_size=2, distributed_executor_backend="ray", num_blocks=16)
