"""Data-parallel replicas as Ray actors (``--data-parallel-backend ray``).

Each replica is a ``RayEngineReplica`` actor in a placement group of its own (one bundle: the
replica's CPU threads, or one GPU), so Ray may put the replicas on any nodes of the cluster. Inside
the actor runs the engine core and the same ``EngineLoop`` an engine process runs
(``core/engine_proc.py``), talking to the frontend over ZMQ tcp:// sockets with the same messages:
the actor binds its input socket on its node's address, the frontend binds its output socket on
its own, and the frontend's side is the ordinary ``ZmqClient`` (``core/zmq_client.py``), so the
``DPClient`` (``core/dp_client.py``) serves Ray replicas exactly as engine processes.

``ActorProcess`` gives the client a process-like view of an actor (``poll``/``wait``/``terminate``
on the actor's long-running ``serve`` call): an actor that dies, or whose engine fails, ends that
call, and the client treats it as an engine process's exit: an engine fault (``EngineDeadError``;
the server answers 503 and exits non-zero). Steps are never cut short for arrivals (that needs a
flag file shared with the frontend's machine).

Ray must be installed (``pip install tokenmill[ray]``); the frontend joins the Ray cluster it is
connected to, or ``ray.init()`` (``RAY_ADDRESS``, or a local cluster).
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from typing import Any

import msgspec
import zmq

from tokenmill.config import EngineConfig
from tokenmill.core.engine_proc import EngineProcessHandle, make_socket_dir
from tokenmill.core.zmq_client import EngineLaunch, Sockets

logger = logging.getLogger(__name__)

# How long a replica's placement group may take to be placed before the server gives up.
PLACEMENT_TIMEOUT_S = 120.0
# Exit code reported for a replica whose actor died (no code of its own).
ACTOR_DIED_CODE = 137


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ValueError("data_parallel_backend='ray' needs Ray: pip install 'tokenmill[ray]'") from exc
    return ray


class RayEngineReplica:
    """The actor's class (wrapped with ``ray.remote`` by ``begin_ray_replicas``): ``bind`` opens the
    input socket and returns its address, ``serve`` runs the engine until it is told to stop."""

    def __init__(self, log_level: str) -> None:
        logging.basicConfig(
            level=log_level, format="%(asctime)s %(levelname)s [ray replica] %(name)s: %(message)s"
        )
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PULL)
        self._input.setsockopt(zmq.RCVHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)

    def bind(self) -> str:
        """Bind the input socket on a free port of this node; its tcp:// address."""
        import ray

        self._input.bind(f"tcp://{ray.util.get_node_ip_address()}:*")
        return str(self._input.getsockopt_string(zmq.LAST_ENDPOINT))

    def serve(self, config_json: bytes, output_address: str) -> int:
        """Build the engine, report ``EngineReady`` (or ``EngineStartFailed``) and serve until
        ``ShutdownEngine``; returns the exit code (1: an engine fault, reported first)."""
        from tokenmill.core.engine_core import EngineCore
        from tokenmill.core.engine_proc import EngineLoop, engine_ready, start_failure
        from tokenmill.loader import resolve_model

        output = self._context.socket(zmq.PUSH)
        output.setsockopt(zmq.SNDHWM, 0)
        output.setsockopt(zmq.LINGER, 1000)
        output.connect(output_address)
        encoder = msgspec.msgpack.Encoder()
        try:
            try:
                config = msgspec.json.decode(config_json, type=EngineConfig)
                core = EngineCore(config, resolve_model(config.model.model))
                logger.info("engine warmed up in %.2f s", core.warm_up())
            except Exception as exc:
                output.send(encoder.encode(start_failure(exc)))
                return 1
            output.send(encoder.encode(engine_ready(core)))
            try:
                return EngineLoop(core, self._input, output, os.getppid(), None).run()
            finally:
                core.shutdown()
        finally:
            self._input.close(linger=0)
            output.close()


class ActorProcess:
    """A replica actor seen as a process (what ``ZmqClient`` and ``stop_engine_process`` use):
    ``poll``/``wait`` watch its ``serve`` call, ``terminate``/``kill`` kill the actor; once it has
    ended its placement group is removed."""

    def __init__(self, ray: Any, actor: Any, group: Any, serve_ref: Any) -> None:
        self._ray = ray
        self._actor = actor
        self._group = group
        self._serve = serve_ref
        self._code: int | None = None
        self._lock = threading.Lock()  # the client's watch thread and its event loop both ask
        self.pid = 0

    def poll(self) -> int | None:
        if self._code is None:
            done, _ = self._ray.wait([self._serve], timeout=0)
            if done:
                self._finish()
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        if self._code is None:
            done, _ = self._ray.wait([self._serve], timeout=timeout)
            if not done:
                raise subprocess.TimeoutExpired("ray replica actor", timeout or 0.0)
            self._finish()
        assert self._code is not None
        return self._code

    def terminate(self) -> None:
        self._ray.kill(self._actor, no_restart=True)

    kill = terminate

    def _finish(self) -> None:
        with self._lock:
            if self._code is None:
                self._finish_once()

    def _finish_once(self) -> None:
        try:
            self._code = int(self._ray.get(self._serve))
        except Exception as exc:  # RayActorError: the actor died
            logger.error("a data-parallel replica's Ray actor died: %s", exc)
            self._code = ACTOR_DIED_CODE
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self._group)


def begin_ray_replicas(config: EngineConfig, size: int, log_level: str) -> list[EngineLaunch]:
    """Start ``size`` replica actors for ``config`` (a replica's config), each in its own placement
    group; the launches are connected and their engines loading. Raises ValueError without Ray and
    RuntimeError when a replica cannot be placed (every actor started is killed)."""
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        ray.init()
    on_gpu = config.model.device.startswith("cuda")
    # A tensor-parallel replica's ranks run inside its actor's bundle (one GPU per rank on CUDA).
    gpus = float(config.tensor_parallel_size)
    bundle: dict[str, float] = {"GPU": gpus} if on_gpu else {"CPU": float(config.num_threads or 1)}
    actor_class = ray.remote(RayEngineReplica)
    config_json = msgspec.json.encode(config)
    launches: list[EngineLaunch] = []
    try:
        for rank in range(size):
            group = placement_group([bundle], strategy="PACK")
            ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                remove_placement_group(group)
                raise RuntimeError(
                    f"Ray could not place data-parallel replica {rank} ({bundle}) within "
                    f"{PLACEMENT_TIMEOUT_S:.0f} s; the cluster has {ray.available_resources()}"
                )
            strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=0)
            options: dict[str, Any] = {"scheduling_strategy": strategy, "max_restarts": 0}
            options |= {"num_gpus": gpus} if on_gpu else {"num_cpus": bundle["CPU"]}
            actor = actor_class.options(**options).remote(log_level)
            try:
                input_address = ray.get(actor.bind.remote(), timeout=PLACEMENT_TIMEOUT_S)
            except Exception:
                ray.kill(actor, no_restart=True)
                remove_placement_group(group)
                raise
            sockets, output_address = _frontend_sockets(ray, input_address)
            process = ActorProcess(ray, actor, group, actor.serve.remote(config_json, output_address))
            handle = EngineProcessHandle(process, input_address, output_address, make_socket_dir())  # type: ignore[arg-type]
            launches.append(EngineLaunch(handle, sockets))
    except BaseException:
        for launch in launches:
            launch.abandon()
        raise
    return launches


def _frontend_sockets(ray: Any, input_address: str) -> tuple[Sockets, str]:
    """The frontend's sockets to one replica (as ``EngineLaunch.begin`` opens them, over tcp): the
    output socket bound on a free port of this node, the input socket connected to the actor's."""
    import zmq.asyncio

    async_context = zmq.asyncio.Context()
    output = async_context.socket(zmq.PULL)
    output.setsockopt(zmq.RCVHWM, 0)
    output.bind(f"tcp://{ray.util.get_node_ip_address()}:*")
    output_address = output.getsockopt_string(zmq.LAST_ENDPOINT)
    sync_context = zmq.Context()
    input_socket = sync_context.socket(zmq.PUSH)
    input_socket.setsockopt(zmq.SNDHWM, 0)
    input_socket.setsockopt(zmq.LINGER, 0)
    input_socket.connect(input_address)
    return (sync_context, input_socket, async_context, output), str(output_address)
