"""``DPClient``: the ``EngineCoreClient`` (``core/client.py``) of a data-parallel server.

N engine processes (replicas, each a whole ``EngineCore`` with its own weights and KV cache) sit
behind one frontend; ``AsyncLLM`` talks to them through this client exactly as to one ``ZmqClient``.

- **Dispatch.** Each request group (the n samples of one user request) goes whole to one replica,
  chosen by a ``DispatchPolicy`` (``router/policy.py``: ``cache_aware`` by default) from the group's
  prompt token ids, hashed by KV block under the radix namespace the engine uses (cache salt and
  LoRA adapter). The replica's answer is the group's answer; a replica refusing it as
  ``overloaded`` hands it to the next least loaded replica, so a 429 means every replica is full.
  The client remembers each core request's replica, for aborts and for the load count, until its
  last output or its abort.
- **Outputs.** One task per replica moves its step outputs into one queue; ``get_outputs`` returns
  one replica's outputs with the gauges summed over the replicas (their latest values), so the
  frontend's metrics describe the whole server. ``replica_stats`` gives each replica's own numbers.
- **Utility calls** go to every replica: ``kv_stats`` sums the counts (``data_parallel_size`` says
  how many), ``reset_prefix_cache`` succeeds when every replica's does, and every other method
  (weight updates, pause, LoRA loading, memory release) must succeed on all and answers with the
  first replica's result. The distributed weight-update group (``init_weights_update_group``,
  ``update_weights_from_distributed``, ``destroy_weights_update_group``) joins one engine to a
  trainer's process group and is refused with data parallelism. A reset or a weight change clears
  the dispatch index, whose entries would be stale.
- **Failure.** One replica dying is an engine fault for the whole server, as one engine dying is
  without data parallelism: every later call raises ``EngineDeadError``, ``get_outputs`` raises it
  once the outputs received are taken (``AsyncLLM`` then fails the requests in flight and the
  server exits for its supervisor to restart it). ``shutdown`` stops every replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass

from tokenmill.config import EngineConfig
from tokenmill.core.client import EngineCoreClient, EngineDeadError, UtilityCallError
from tokenmill.core.dp_spawn import replica_config
from tokenmill.core.engine_proc import EngineProcessHandle
from tokenmill.core.kv.kv_events import block_hashes
from tokenmill.core.zmq_client import EngineLaunch
from tokenmill.protocol import (
    AddResult,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    UtilityValue,
)
from tokenmill.router.policy import DispatchPolicy, PromptKey
from tokenmill.router.prefix_index import EventFedPrefixes

logger = logging.getLogger(__name__)

# Methods that bind one engine to an outside process group: meaningless fanned out over replicas.
REFUSED_WITH_DP = frozenset(
    {"init_weights_update_group", "update_weights_from_distributed", "destroy_weights_update_group"}
)
# Methods after which the replicas' caches hold nothing the dispatch index remembers.
CLEARS_INDEX = frozenset(
    {"update_weights_from_disk", "update_weights_from_tensor", "resume_memory_occupation"}
)
# kv_stats values that describe each replica alike rather than add up.
_KV_STATS_SHARED = frozenset({"block_size", "weight_version", "usage", "all_free_or_cached", "paused"})


@dataclass
class ReplicaStats:
    """One replica's numbers (``tokenmill:dp_replica_*`` gauges): requests the frontend sent it that
    have not ended (``in_flight``), requests sent in all (``dispatched``), its latest gauges, its
    prefix-cache totals, and the prompt tokens the dispatch index expected it to have cached
    (``predicted_hit_tokens``) beside those it reported (``cached_prompt_tokens``)."""

    replica: str
    alive: bool
    in_flight: int
    dispatched: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    predicted_hit_tokens: int
    cached_prompt_tokens: int


class DPLaunch:
    """The replicas' engine processes started, not yet ready; ``wait_ready`` or ``abandon`` it."""

    def __init__(self, config: EngineConfig, launches: list[EngineLaunch]) -> None:
        self.config = config
        self.launches = launches

    @classmethod
    def begin(
        cls,
        config: EngineConfig,
        *,
        log_level: str = "INFO",
        spawned: Sequence[EngineProcessHandle] | None = None,
    ) -> DPLaunch:
        """Start ``data_parallel_size`` engine processes for ``config`` (or take ``spawned``, started
        by ``spawn_engines``)."""
        size = config.data_parallel.data_parallel_size
        if spawned and len(spawned) != size:
            raise ValueError(f"{len(spawned)} engine processes were started for data_parallel_size {size}")
        replica = replica_config(config)
        if config.data_parallel.data_parallel_backend == "ray":
            if spawned:
                raise ValueError(
                    "data_parallel_backend='ray' places its replicas itself; spawned must be empty"
                )
            from tokenmill.core.dp_ray import begin_ray_replicas

            return cls(config, begin_ray_replicas(replica, size, log_level))
        launches: list[EngineLaunch] = []
        try:
            for rank in range(size):
                handle = spawned[rank] if spawned else None
                launches.append(EngineLaunch.begin(replica, log_level=log_level, spawned=handle))
        except BaseException:
            for launch in launches:
                launch.abandon()
            raise
        return cls(config, launches)

    async def wait_ready(self, timeout: float) -> DPClient:
        """The client, once every replica is ready. Raises RuntimeError naming the replica when one
        fails to start (the caller then ``abandon``s the launch)."""

        async def one(rank: int, launch: EngineLaunch) -> EngineCoreClient:
            try:
                return await launch.wait_ready(timeout)
            except RuntimeError as exc:
                raise RuntimeError(f"data-parallel engine {rank}: {exc}") from None

        results = await asyncio.gather(
            *(one(rank, launch) for rank, launch in enumerate(self.launches)), return_exceptions=True
        )
        clients = [r for r in results if not isinstance(r, BaseException)]
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            for client in clients:
                await client.shutdown()
            raise failures[0]
        dp = self.config.data_parallel
        policy = DispatchPolicy(dp.dp_policy, balance_abs=dp.dp_balance_abs, balance_rel=dp.dp_balance_rel)
        return DPClient(clients, policy)  # type: ignore[arg-type]

    def abandon(self) -> None:
        for launch in self.launches:
            launch.abandon()


class DPClient:
    """``EngineCoreClient`` over several engine clients (replicas); see the module docstring.

    Made inside the event loop it serves (it starts one output task per replica).
    """

    def __init__(self, clients: Sequence[EngineCoreClient], policy: DispatchPolicy) -> None:
        if not clients:
            raise ValueError("a data-parallel client needs at least one engine")
        infos = [client.info for client in clients]
        if len({(i.max_model_len, i.block_size) for i in infos}) != 1:
            raise ValueError("data-parallel engines disagree on max_model_len or block_size")
        self.clients = list(clients)
        self.policy = policy
        self.names = [str(rank) for rank in range(len(clients))]
        self.block_size = infos[0].block_size
        # Each replica's index is fed by its own cache events (core/kv/kv_events.py).
        self.indexes = [EventFedPrefixes(max(1, info.num_blocks)) for info in infos]
        for name, info, index in zip(self.names, infos, self.indexes, strict=True):
            policy.add_replica(name, capacity_chunks=max(1, info.num_blocks), index=index)
        self.info = EngineReady(
            max_model_len=infos[0].max_model_len,
            num_blocks=sum(i.num_blocks for i in infos),
            block_size=self.block_size,
            pid=infos[0].pid,
            kv_cache_bytes=sum(i.kv_cache_bytes for i in infos),
        )
        self.pids = [i.pid for i in infos]
        # Core request id -> the replica serving it, until its last output or its abort.
        self._owner: dict[str, int] = {}
        # Core request id -> prompt tokens the index expected cached, until its first output.
        self._predicted: dict[str, int] = {}
        # A group's first core request id -> its replica and prompt hashes, pending in that
        # replica's index until the request's first output or its end.
        self._pending: dict[str, tuple[int, list[int]]] = {}
        self._latest = [EngineCoreOutputs(outputs=[]) for _ in clients]
        self._dispatched = [0] * len(clients)
        self._predicted_hits = [0] * len(clients)
        self._reported_hits = [0] * len(clients)
        self._merged: asyncio.Queue[tuple[int, EngineCoreOutputs] | None] = asyncio.Queue()
        self._dead_reason: str | None = None
        self._closed = False
        self._pumps = [
            asyncio.create_task(self._pump(rank), name=f"tokenmill-dp-outputs-{rank}")
            for rank in range(len(clients))
        ]

    # ------------------------------------------------------------------ EngineCoreClient

    @property
    def can_cut_steps(self) -> bool:
        return all(client.can_cut_steps for client in self.clients)

    @property
    def is_alive(self) -> bool:
        return self._dead_reason is None and all(client.is_alive for client in self.clients)

    @property
    def dead_reason(self) -> str | None:
        if self._dead_reason is not None:
            return self._dead_reason
        for rank, client in enumerate(self.clients):
            if client.dead_reason is not None:
                return f"data-parallel engine {rank}: {client.dead_reason}"
        return None

    async def add_request_group(
        self, requests: list[EngineCoreRequest], *, cut_step: bool = False
    ) -> AddResult:
        if not requests:
            raise ValueError("a request group needs at least one request")
        reason = self.dead_reason
        if reason is not None:
            raise EngineDeadError(reason)
        first = requests[0]
        namespace = (first.cache_salt, first.lora_name)
        key = PromptKey(block_hashes(namespace, first.prompt_token_ids, self.block_size))
        tried: list[str] = []
        while True:
            available = [name for name in self.names if name not in tried]
            decision = self.policy.choose(key, available)
            rank = int(decision.replica)
            self._dispatch(rank, requests, key, decision.matched_chunks)
            try:
                result = await self.clients[rank].add_request_group(requests, cut_step=cut_step)
            except BaseException:
                self._forget(rank, [r.request_id for r in requests])
                raise
            if result.error is None:
                return result
            self._forget(rank, [r.request_id for r in requests])
            tried.append(decision.replica)
            if not result.overloaded or len(tried) == len(self.names):
                return result

    def abort_requests(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self._owner.get(request_id)
            if rank is not None:
                by_rank.setdefault(rank, []).append(request_id)
        for rank, ids in by_rank.items():
            self._forget(rank, ids)
            self.clients[rank].abort_requests(ids)

    async def get_outputs(self) -> EngineCoreOutputs:
        if self._dead_reason is not None and self._merged.empty():
            raise EngineDeadError(self._dead_reason)
        item = await self._merged.get()
        if item is None:
            raise EngineDeadError(self._dead_reason or "a data-parallel engine is gone")
        rank, outputs = item
        return self._on_outputs(rank, outputs)

    async def call_utility(
        self, method: str, args: dict[str, UtilityValue] | None = None
    ) -> dict[str, UtilityValue]:
        reason = self.dead_reason
        if reason is not None:
            raise EngineDeadError(reason)
        if method in REFUSED_WITH_DP:
            raise UtilityCallError(
                f"ValueError: {method} is not supported with data parallelism (data_parallel_size "
                f"{len(self.clients)}): it joins one engine to the trainer's process group"
            )
        results = await asyncio.gather(
            *(client.call_utility(method, args) for client in self.clients), return_exceptions=True
        )
        for rank, result in enumerate(results):
            if isinstance(result, BaseException):
                if isinstance(result, UtilityCallError):
                    raise UtilityCallError(f"data-parallel engine {rank}: {result}") from result
                raise result
        answers: list[dict[str, UtilityValue]] = results  # type: ignore[assignment]
        if method == "kv_stats":
            return self._sum_kv_stats(answers)
        if method == "reset_prefix_cache":
            for rank, answer in enumerate(answers):
                if answer.get("success"):
                    self.policy.clear_prefixes(self.names[rank])
            return {"success": all(bool(answer.get("success")) for answer in answers)}
        if method in CLEARS_INDEX:
            self.policy.clear_prefixes()
        return answers[0]

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every replica (concurrently) and the output tasks; idempotent."""
        if self._closed:
            return
        self._closed = True
        for pump in self._pumps:
            pump.cancel()
        for pump in self._pumps:
            with suppress(asyncio.CancelledError):
                await pump
        await asyncio.gather(*(client.shutdown(timeout) for client in self.clients))
        if self._dead_reason is None:
            self._dead_reason = "the server is shutting down"
            self._merged.put_nowait(None)

    # ------------------------------------------------------------------ per-replica numbers

    def replica_stats(self) -> list[ReplicaStats]:
        """Each replica's numbers, in rank order."""
        stats = []
        for rank, (name, client) in enumerate(zip(self.names, self.clients, strict=True)):
            latest = self._latest[rank]
            stats.append(
                ReplicaStats(
                    replica=name,
                    alive=client.is_alive,
                    in_flight=self.policy.loads.get(name, 0),
                    dispatched=self._dispatched[rank],
                    num_running=latest.num_running,
                    num_waiting=latest.num_waiting,
                    kv_cache_usage=latest.kv_cache_usage,
                    prefix_cache_queried_tokens=latest.prefix_cache_queried_tokens,
                    prefix_cache_hit_tokens=latest.prefix_cache_hit_tokens,
                    predicted_hit_tokens=self._predicted_hits[rank],
                    cached_prompt_tokens=self._reported_hits[rank],
                )
            )
        return stats

    # ------------------------------------------------------------------ helpers

    def _dispatch(self, rank: int, requests: list[EngineCoreRequest], key: PromptKey, matched: int) -> None:
        self.policy.on_dispatch(self.names[rank], key, len(requests))
        self._dispatched[rank] += 1
        predicted = matched * self.block_size
        self._pending[requests[0].request_id] = (rank, key.hashes)
        for request in requests:
            self._owner[request.request_id] = rank
            self._predicted[request.request_id] = predicted

    def _forget(self, rank: int, request_ids: list[str]) -> None:
        ended = 0
        for request_id in request_ids:
            if self._owner.pop(request_id, None) is not None:
                ended += 1
            self._predicted.pop(request_id, None)
            self._settle(request_id)
        self.policy.on_finish(self.names[rank], ended)

    def _settle(self, request_id: str) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            self.indexes[pending[0]].settle(pending[1])

    def _on_outputs(self, rank: int, batch: EngineCoreOutputs) -> EngineCoreOutputs:
        """Account for one replica's step (ends, cache hits) and return it with the gauges summed
        over every replica's latest."""
        self._latest[rank] = batch
        index = self.indexes[rank]
        for event in batch.kv_events:
            index.apply(event.kind, event.block_hashes)
        ended: list[str] = []
        for output in batch.outputs:
            self._settle(output.request_id)
            predicted = self._predicted.pop(output.request_id, None)
            if predicted is not None:
                self._predicted_hits[rank] += predicted
                self._reported_hits[rank] += output.num_cached_tokens
            if output.finish_reason is not None:
                ended.append(output.request_id)
        if ended:
            self._forget(rank, ended)
        latest = self._latest
        blocks = [client.info.num_blocks for client in self.clients]
        return EngineCoreOutputs(
            outputs=batch.outputs,
            num_running=sum(o.num_running for o in latest),
            num_waiting=sum(o.num_waiting for o in latest),
            kv_cache_usage=sum(o.kv_cache_usage * b for o, b in zip(latest, blocks, strict=True))
            / max(1, sum(blocks)),
            num_preemptions=batch.num_preemptions,
            prefix_cache_queried_tokens=sum(o.prefix_cache_queried_tokens for o in latest),
            prefix_cache_hit_tokens=sum(o.prefix_cache_hit_tokens for o in latest),
            num_running_by_tier=_sum_dicts([o.num_running_by_tier for o in latest]),
            num_waiting_by_tier=_sum_dicts([o.num_waiting_by_tier for o in latest]),
            num_forced_tokens=batch.num_forced_tokens,
            spec_num_draft_tokens=sum(o.spec_num_draft_tokens for o in latest),
            spec_num_accepted_tokens=sum(o.spec_num_accepted_tokens for o in latest),
            spec_accepted_per_position=_sum_lists([o.spec_accepted_per_position for o in latest]),
        )

    def _sum_kv_stats(self, answers: list[dict[str, UtilityValue]]) -> dict[str, UtilityValue]:
        total: dict[str, UtilityValue] = {}
        for answer in answers:
            for name, value in answer.items():
                previous = total.get(name)
                if name not in total:
                    total[name] = value
                elif name not in _KV_STATS_SHARED and _is_number(value) and _is_number(previous):
                    total[name] = previous + value  # type: ignore[operator]
        blocks = [int(a.get("num_blocks") or 0) for a in answers]  # type: ignore[arg-type]
        usages = [float(a.get("usage") or 0.0) for a in answers]  # type: ignore[arg-type]
        total["usage"] = sum(u * b for u, b in zip(usages, blocks, strict=True)) / max(1, sum(blocks))
        total["all_free_or_cached"] = all(bool(a.get("all_free_or_cached")) for a in answers)
        total["paused"] = any(bool(a.get("paused")) for a in answers)
        total["data_parallel_size"] = len(answers)
        return total

    async def _pump(self, rank: int) -> None:
        """Move replica ``rank``'s step outputs into the merged queue; its death kills the client."""
        client = self.clients[rank]
        try:
            while True:
                self._merged.put_nowait((rank, await client.get_outputs()))
        except EngineDeadError as exc:
            if self._dead_reason is None:
                if not self._closed:
                    logger.error("data-parallel engine %d is gone: %s", rank, exc)
                self._dead_reason = f"data-parallel engine {rank}: {exc}"
                self._merged.put_nowait(None)


def _sum_dicts(values: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for value in values:
        for name, count in value.items():
            total[name] = total.get(name, 0) + count
    return total


def _sum_lists(values: list[list[int]]) -> list[int]:
    total: list[int] = []
    for value in values:
        total.extend([0] * (len(value) - len(total)))
        for index, count in enumerate(value):
            total[index] += count
    return total


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
