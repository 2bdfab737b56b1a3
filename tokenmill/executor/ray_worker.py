"""A tensor-parallel rank as a Ray actor: the same ``WorkerHandler`` the worker process runs.

``RayExecutor`` (``executor/ray_executor.py``) creates one actor per rank in a placement group.
Requests and replies cross as msgspec bytes of ``protocol.py`` (Ray only frames the bytes), so the
actor answers exactly what a worker process answers: ``start`` loads the rank's shard after joining
the torch.distributed group and returns ``WorkerReady`` or ``WorkerFailed``; ``handle`` answers one
``WorkerRequest``. A request that raises is answered ``WorkerFailed`` and the actor refuses every
later one (its state may be half-updated); the executor then kills the group.
"""

from __future__ import annotations

import logging
import traceback

import msgspec

from tokenmill.config import EngineConfig
from tokenmill.executor.worker_proc import RankPlacement, WorkerHandler
from tokenmill.protocol import WorkerCallResult, WorkerFailed, WorkerReply, WorkerRequest

logger = logging.getLogger(__name__)


class RayRankWorker:
    """The actor's class (wrapped with ``ray.remote`` by the executor, so this module needs no Ray)."""

    def __init__(self, log_level: str) -> None:
        logging.basicConfig(
            level=log_level, format="%(asctime)s %(levelname)s [ray worker] %(name)s: %(message)s"
        )
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(WorkerRequest).decode
        self._handler: WorkerHandler | None = None
        self._failure: str | None = None

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a free port on it, where the group's rank 0 hosts the store."""
        import ray

        from tokenmill.worker.distributed import free_tcp_port

        host = ray.util.get_node_ip_address()
        return host, free_tcp_port(host)

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def start(self, config_json: bytes, rank: int, size: int, init_method: str | None) -> bytes:
        """Join the group and load this rank's shard; ``WorkerReady`` or ``WorkerFailed`` bytes."""
        try:
            config = msgspec.json.decode(config_json, type=EngineConfig)
            self._handler = WorkerHandler.start(config, RankPlacement(rank, size, init_method))
            return self._encode(self._handler.ready())
        except Exception as exc:
            logger.error("rank %d failed to start:\n%s", rank, traceback.format_exc())
            return self._failed(exc)

    def handle(self, data: bytes) -> bytes:
        """One request's reply (``WorkerCallResult`` for ``ShutdownWorker``, after leaving the group)."""
        if self._failure is not None or self._handler is None:
            return self._encode(WorkerFailed(error=self._failure or "the worker never started"))
        message = self._decode(data)
        try:
            reply: WorkerReply | None = self._handler.handle(message)
        except Exception as exc:
            logger.error("request %s failed:\n%s", type(message).__name__, traceback.format_exc())
            return self._failed(exc)
        if reply is None:
            self._handler.close()
            reply = WorkerCallResult()
        return self._encode(reply)

    def _failed(self, exc: Exception) -> bytes:
        self._failure = f"{type(exc).__name__}: {exc}"
        return self._encode(WorkerFailed(error=self._failure))
