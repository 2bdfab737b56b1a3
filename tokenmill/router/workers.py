"""The router's workers: separate ``tokenmill serve`` processes (or any server with the same routes),
their health, and which of them the dispatch policy may choose.

A worker is *healthy* while its ``GET /health`` answers 200. The pool checks every worker every
``health_interval`` seconds; a worker that fails ``failure_threshold`` checks in a row, or that
refuses a forwarded request's connection, leaves the policy (no request goes to it, its prefix
index is dropped) and rejoins, with an empty index, once a check passes again. Workers added at run
time start unhealthy and join after their first passing check (``add`` waits for it).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress
from dataclasses import dataclass

import httpx

from tokenmill.router.policy import DispatchPolicy

logger = logging.getLogger("tokenmill.router")


@dataclass
class Worker:
    """One worker: its base URL (no trailing slash), health and counters."""

    url: str
    healthy: bool = False
    failures: int = 0
    dispatched: int = 0
    errors: int = 0


def normalize_url(url: str) -> str:
    """``http://host:port`` without a trailing slash; ValueError for anything not http(s)."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise ValueError(f"a worker URL must start with http:// or https://, got {url!r}")
    return url


class WorkerPool:
    """The workers and their health, kept in step with the policy's replicas (named by URL)."""

    def __init__(
        self,
        policy: DispatchPolicy,
        http: httpx.AsyncClient,
        *,
        capacity_chunks: int,
        health_interval: float = 5.0,
        health_timeout: float = 5.0,
        failure_threshold: int = 2,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.policy = policy
        self.http = http
        self.capacity_chunks = capacity_chunks
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.failure_threshold = failure_threshold
        self.headers = headers or {}
        self.workers: dict[str, Worker] = {}
        self._task: asyncio.Task[None] | None = None

    @property
    def healthy(self) -> list[str]:
        return [url for url, worker in self.workers.items() if worker.healthy]

    async def add(self, url: str) -> Worker:
        """Add a worker (a known one is kept) and check it at once; returns it, healthy or not."""
        url = normalize_url(url)
        worker = self.workers.get(url)
        if worker is None:
            worker = self.workers[url] = Worker(url)
            logger.info("worker %s added", url)
        await self.check(worker)
        return worker

    def remove(self, url: str) -> bool:
        """Forget a worker; False when it was not known. Requests in flight to it go on."""
        worker = self.workers.pop(normalize_url(url), None)
        if worker is None:
            return False
        self.policy.remove_replica(worker.url)
        logger.info("worker %s removed", worker.url)
        return True

    async def check(self, worker: Worker) -> bool:
        """One health check; updates the worker's state and the policy's replicas."""
        try:
            response = await self.http.get(
                f"{worker.url}/health", headers=self.headers, timeout=self.health_timeout
            )
            ok = response.status_code == 200
        except httpx.HTTPError:
            ok = False
        if worker.url not in self.workers:  # removed while the check ran
            return ok
        if ok:
            worker.failures = 0
            if not worker.healthy:
                worker.healthy = True
                self.policy.add_replica(worker.url, self.capacity_chunks)
                logger.info("worker %s is healthy", worker.url)
        else:
            worker.failures += 1
            if worker.healthy and worker.failures >= self.failure_threshold:
                self.mark_unhealthy(worker.url, "failed its health checks")
        return ok

    def mark_unhealthy(self, url: str, why: str) -> None:
        """Take a worker out of dispatch until a health check passes again."""
        worker = self.workers.get(url)
        if worker is None or not worker.healthy:
            return
        worker.healthy = False
        self.policy.remove_replica(url)
        logger.warning("worker %s %s; no request goes to it until it is healthy again", url, why)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._health_loop(), name="tokenmill-router-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await asyncio.gather(*(self.check(worker) for worker in list(self.workers.values())))
