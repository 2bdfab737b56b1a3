"""The executor whose tensor-parallel ranks are Ray actors (``--distributed-executor-backend ray``).

The ranks are ``RayRankWorker`` actors (``executor/ray_worker.py``) in one placement group with one
bundle per rank (its CPU threads, or one GPU) under ``STRICT_PACK``: a tensor-parallel group talks
after every layer, so all of it goes on one node, and bundle 0 asks for the engine's own node, so
the group runs beside the engine (whose interrupt flag file its ranks map). torch.distributed is
initialised between the actors (gloo on CPU, nccl on CUDA) with rank 0 hosting the store on a free
port of its node. Requests cross as the same msgspec bytes the worker processes get.

Ray must be installed (``pip install tokenmill[ray]``). The executor joins the Ray cluster this
process is connected to, or starts ``ray.init()`` (which connects to ``RAY_ADDRESS`` or starts a
local one). An actor that dies (``RayActorError``) or a rank that fails is an engine fault: every
actor is killed and the placement group removed, and every later call raises
``WorkerProcessError``; every wait is in slices, so nothing hangs.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import msgspec

from tokenmill.config import EngineConfig
from tokenmill.executor.multiproc import config_for_ranks
from tokenmill.executor.rank_group import RankGroupExecutor, WorkerProcessError
from tokenmill.executor.ray_worker import RayRankWorker
from tokenmill.loader import ModelSource
from tokenmill.protocol import ShutdownWorker, WorkerCallResult, WorkerFailed, WorkerReply, WorkerRequest

logger = logging.getLogger(__name__)

# How long a wait for the actors lasts before it checks again (replies come at once; an actor's
# death resolves its pending call with an error, so this only paces the loop).
WAIT_SLICE_S = 0.2
# How long a rank's failure waits to learn whether a peer's actor died first (the likely cause).
DEATH_CHECK_S = 1.0
# How long the placement group may take to be placed before the engine gives up.
PLACEMENT_TIMEOUT_S = 120.0


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ValueError(
            "distributed_executor_backend='ray' needs Ray: pip install 'tokenmill[ray]'"
        ) from exc
    return ray


class RayExecutor(RankGroupExecutor):
    """``executor/base.py`` over ``tensor_parallel_size`` Ray actors (see the module docstring)."""

    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        super().__init__(config.tensor_parallel_size)
        ray = self._ray = _import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init()
        self._remove_group = remove_placement_group
        rank_config = config_for_ranks(config)
        on_gpu = config.model.device.startswith("cuda")
        bundle: dict[str, float] = {"GPU": 1.0} if on_gpu else {"CPU": float(rank_config.num_threads or 1)}
        here = f"node:{ray.util.get_node_ip_address()}"
        bundles = [{**bundle, here: 0.001}] + [dict(bundle) for _ in range(self._size - 1)]
        self._group = placement_group(bundles, strategy="STRICT_PACK")
        self._actors: list[Any] = []
        self._inflight: list[Any] = []  # the current exchange's calls, in rank order
        self._stopped = False
        try:
            ready, _ = ray.wait([self._group.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                raise WorkerProcessError(
                    f"Ray could not place {self._size} ranks of {bundle} on one node (STRICT_PACK) "
                    f"within {PLACEMENT_TIMEOUT_S:.0f} s; the cluster has {ray.available_resources()}"
                )
            actor_class = ray.remote(RayRankWorker)
            log_level = logging.getLevelName(logging.getLogger("tokenmill").getEffectiveLevel())
            for rank in range(self._size):
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=self._group, placement_group_bundle_index=rank
                )
                options: dict[str, Any] = {"scheduling_strategy": strategy, "max_restarts": 0}
                options |= {"num_gpus": 1} if on_gpu else {"num_cpus": bundle["CPU"]}
                self._actors.append(actor_class.options(**options).remote(log_level))
            self._start(rank_config)
        except BaseException:
            self._stop()
            raise
        logger.info("%d Ray actor rank(s) ready", self._size)

    def _start(self, config: EngineConfig) -> None:
        init_method = None
        if self._size > 1:
            host, port = self._wait_one(self._actors[0].rendezvous_address.remote(), "starting")
            init_method = f"tcp://{host}:{port}"
        config_json = msgspec.json.encode(config)
        self._pending = [
            actor.start.remote(config_json, rank, self._size, init_method)
            for rank, actor in enumerate(self._actors)
        ]
        self._ready()

    @property
    def node_ids(self) -> list[str]:
        """The Ray node of every rank, in rank order."""
        return [self._wait_one(actor.node_id.remote(), "asking for its node") for actor in self._actors]

    @property
    def actors(self) -> list[Any]:
        """The rank actors' handles, in rank order (for tests and operators)."""
        return list(self._actors)

    def shutdown(self) -> None:
        if not self._stopped and self._failure is None:
            with contextlib.suppress(WorkerProcessError):  # stopped below either way
                self._ask(ShutdownWorker(), "shutting down", WorkerCallResult)
        self._failure = self._failure or "the executor was shut down"
        self._stop()

    # ------------------------------------------------------------------ the wire

    def _stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for actor in self._actors:
            self._ray.kill(actor, no_restart=True)
        self._remove_group(self._group)

    def _exited_rank(self, other_than: int) -> tuple[int, str] | None:
        """A rank whose call of the current exchange ended in its actor's death (a dead actor's
        pending call resolves with ``RayActorError`` at once; a live rank's may never, so the
        wait is short)."""
        ray = self._ray
        for rank, ref in enumerate(self._inflight):
            if rank == other_than:
                continue
            ready, _ = ray.wait([ref], timeout=DEATH_CHECK_S)
            if ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    return rank, "(a Ray actor) died"
        return None

    def _wait_one(self, ref: Any, what: str) -> Any:
        return self._wait_all([ref], what)[0]

    def _wait_all(self, refs: list[Any], what: str, decode: Any = None) -> list[Any]:
        """Every ref's value in order (``decode``d); ``_fail`` when an actor died or a call raised.
        With ``decode``, stops at the first ``WorkerFailed`` (None for the refs not awaited): its
        peers may be waiting in a collective for the rank that failed."""
        ray = self._ray
        values: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=WAIT_SLICE_S)
            for ref in done:
                rank = refs.index(ref)
                try:
                    value = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    self._fail(f"{self._worker_name(rank)} (a Ray actor) died while {what}: {exc}")
                except ray.exceptions.RayError as exc:
                    self._fail(f"{self._worker_name(rank)} (a Ray actor) failed while {what}: {exc}")
                values[rank] = value if decode is None else decode(value)
                if isinstance(values[rank], WorkerFailed):
                    return values
        return values

    def _exchange(self, message: WorkerRequest | None, what: str) -> list[WorkerReply | None]:
        if message is None:
            refs, self._pending = self._pending, []
            self._inflight = refs
        else:
            data = msgspec.msgpack.encode(message)
            refs = [actor.handle.remote(data) for actor in self._actors]
        self._inflight = refs
        return self._wait_all(refs, what, msgspec.msgpack.Decoder(WorkerReply).decode)
