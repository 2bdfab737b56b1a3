"""``tokenmill router``: one HTTP endpoint in front of several ``tokenmill serve`` workers.

Forwarded with a dispatch policy (``router/policy.py``, the one the data-parallel server uses):
``POST /v1/chat/completions``, ``/v1/completions`` and ``/generate`` (SGLang's native route). The
request body goes to the chosen worker unchanged; the answer comes back with its status and headers,
a stream (SSE) chunk by chunk as the worker sends it. The policy's key is the request's text: the
chat ``messages`` as compact JSON, the completion ``prompt`` (or its token ids), ``/generate``'s
``text`` (or ``input_ids``), cut into ``CHARS_PER_CHUNK``-character chunks under the namespace
(route, ``model``, ``cache_salt``), so requests sharing a system prompt share leading chunks.
A worker's load is the router's count of requests it forwarded there and that have not ended.

Forwarded to any healthy worker, without dispatch: ``GET /v1/models``, ``/v1/models/{id}``,
``/model_info``, ``/get_model_info``.

The router's own routes: ``GET /health`` (200 while a worker is healthy, else 503), ``GET /workers``,
``POST /workers`` (``{"url": ...}``), ``DELETE /workers/{url}`` (and SGLang's router's names
``/list_workers``, ``POST /add_worker?url=``, ``POST /remove_worker?url=``), and ``GET /metrics``
(``tokenmill_router:*`` per worker). With API keys every route but ``/health`` needs one.

Failure: a worker that refuses the connection is taken out (``WorkerPool.mark_unhealthy``) and the
request goes to another; with no healthy worker the answer is 503. A worker that fails after it
accepted the request gets the client a 502 (a stream just ends: the worker's own error events pass
through). The router imports nothing of the server or the engine.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Hashable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.router.policy import DispatchPolicy, PromptKey
from tokenmill.router.workers import WorkerPool, normalize_url

logger = logging.getLogger("tokenmill.router")

CHARS_PER_CHUNK = 16
DISPATCHED_ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate")
PASSED_ROUTES = ("/v1/models", "/model_info", "/get_model_info")
# Request headers a worker needs; the rest (host, content-length, hop-by-hop) are the router's own.
_FORWARDED_REQUEST_HEADERS = ("content-type", "accept", "authorization", "x-request-id")
_DROPPED_RESPONSE_HEADERS = frozenset(
    {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding", "date", "server"}
)


@dataclass
class RouterSettings:
    """How the router behaves (``tokenmill router``'s options)."""

    worker_urls: list[str] = field(default_factory=list)
    policy: str = "cache_aware"
    balance_abs: int = 8
    balance_rel: float = 1.5
    api_keys: list[str] = field(default_factory=list)
    worker_api_key: str | None = None  # sent to workers; else the client's Authorization is passed on
    health_interval: float = 5.0
    health_failure_threshold: int = 2
    request_timeout: float = 600.0
    prefix_chars: int = 4_000_000  # each worker's prefix index holds this many characters


def error_response(status: int, message: str, code: str) -> JSONResponse:
    """An OpenAI-shaped error body."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status)


def prompt_key(path: str, body: dict[str, Any]) -> PromptKey:
    """The policy's key for a request body (see the module docstring)."""
    units: Sequence[Hashable]
    if path == "/v1/chat/completions":
        units = json.dumps(body.get("messages"), separators=(",", ":"), ensure_ascii=False)
    elif path == "/v1/completions":
        units = _prompt_units(body.get("prompt"))
    else:
        units = _prompt_units(body.get("text") if body.get("text") is not None else body.get("input_ids"))
    namespace = (path, str(body.get("model")), str(body.get("cache_salt")))
    return PromptKey.of(namespace, units, CHARS_PER_CHUNK)


def _prompt_units(prompt: object) -> Sequence[Hashable]:
    """A prompt's text, or its token ids; for a batch, its first prompt."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    return ""


class _APIKeyGuard:
    """Every route but ``/health`` needs ``Authorization: Bearer <one of the keys>``."""

    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app = app
        self.keys = {f"Bearer {key}" for key in api_keys}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            headers = dict(scope["headers"])
            if headers.get(b"authorization", b"").decode("latin-1") not in self.keys:
                await error_response(401, "a valid API key is required", "invalid_api_key")(
                    scope, receive, send
                )
                return
        await self.app(scope, receive, send)


class _RouterCollector:
    """``tokenmill_router:*`` metrics, read from the pool at scrape time."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def collect(self) -> list[Metric]:
        workers = list(self.pool.workers.values())
        requests = GaugeMetricFamily(
            "tokenmill_router:worker_requests", "Requests in flight.", labels=["worker"]
        )
        healthy = GaugeMetricFamily("tokenmill_router:worker_healthy", "1 while healthy.", labels=["worker"])
        dispatched = CounterMetricFamily(
            "tokenmill_router:worker_dispatched", "Requests forwarded to the worker.", labels=["worker"]
        )
        errors = CounterMetricFamily(
            "tokenmill_router:worker_errors", "Requests the worker failed to answer.", labels=["worker"]
        )
        for worker in workers:
            requests.add_metric([worker.url], self.pool.policy.loads.get(worker.url, 0))
            healthy.add_metric([worker.url], float(worker.healthy))
            dispatched.add_metric([worker.url], worker.dispatched)
            errors.add_metric([worker.url], worker.errors)
        return [requests, healthy, dispatched, errors]


class Router:
    """The forwarding logic behind the routes; one per app."""

    def __init__(self, settings: RouterSettings, pool: WorkerPool) -> None:
        self.settings = settings
        self.pool = pool
        self.policy = pool.policy
        self.http = pool.http

    def _headers(self, request: Request) -> dict[str, str]:
        headers = {
            name: request.headers[name] for name in _FORWARDED_REQUEST_HEADERS if name in request.headers
        }
        if self.settings.worker_api_key is not None:
            headers["authorization"] = f"Bearer {self.settings.worker_api_key}"
        return headers

    async def dispatch(self, request: Request) -> Response:
        """Forward a generation request to the worker the policy chooses."""
        body = await request.body()
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        key = prompt_key(request.url.path, parsed if isinstance(parsed, dict) else {})
        tried: list[str] = []
        while True:
            available = [url for url in self.pool.healthy if url not in tried]
            if not available:
                return error_response(503, "no healthy worker is available", "no_healthy_worker")
            url = self.policy.choose(key, available).replica
            self.policy.on_dispatch(url, key)
            self.pool.workers[url].dispatched += 1
            upstream_request = self.http.build_request(
                request.method,
                url + request.url.path,
                params=request.query_params,
                content=body,
                headers=self._headers(request),
                timeout=self.settings.request_timeout,
            )
            try:
                upstream = await self.http.send(upstream_request, stream=True)
            except httpx.ConnectError:
                # Nothing reached the worker: another may serve the request.
                self._ended(url, error=True)
                self.pool.mark_unhealthy(url, "refused a connection")
                tried.append(url)
                continue
            except httpx.HTTPError as exc:
                self._ended(url, error=True)
                return error_response(502, f"worker {url} failed: {type(exc).__name__}", "worker_failed")
            return await self._answer(url, upstream)

    async def _answer(self, url: str, upstream: httpx.Response) -> Response:
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROPPED_RESPONSE_HEADERS}
        if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                content = await upstream.aread()
            except httpx.HTTPError as exc:
                self._ended(url, error=True)
                return error_response(502, f"worker {url} failed: {type(exc).__name__}", "worker_failed")
            finally:
                await upstream.aclose()
            self._ended(url, error=upstream.status_code >= 500)
            return Response(content, upstream.status_code, headers)

        async def relay() -> AsyncIterator[bytes]:
            error = False
            try:
                async for chunk in upstream.aiter_bytes():
                    yield chunk
            except httpx.HTTPError:
                error = True  # the worker went away mid-stream: the stream ends here
            finally:
                await upstream.aclose()
                self._ended(url, error=error)

        return StreamingResponse(relay(), upstream.status_code, headers)

    def _ended(self, url: str, *, error: bool) -> None:
        self.policy.on_finish(url)
        worker = self.pool.workers.get(url)
        if worker is not None and error:
            worker.errors += 1

    async def pass_through(self, request: Request) -> Response:
        """Forward a read-only request to any healthy worker."""
        for url in self.pool.healthy:
            try:
                upstream = await self.http.request(
                    request.method,
                    url + request.url.path,
                    params=request.query_params,
                    headers=self._headers(request),
                    timeout=self.settings.request_timeout,
                )
            except httpx.ConnectError:
                self.pool.mark_unhealthy(url, "refused a connection")
                continue
            headers = {
                k: v for k, v in upstream.headers.items() if k.lower() not in _DROPPED_RESPONSE_HEADERS
            }
            return Response(upstream.content, upstream.status_code, headers)
        return error_response(503, "no healthy worker is available", "no_healthy_worker")


def build_router_app(settings: RouterSettings) -> FastAPI:
    """The router's app; its lifespan adds the configured workers and runs the health checks."""
    policy = DispatchPolicy(
        settings.policy, balance_abs=settings.balance_abs, balance_rel=settings.balance_rel
    )
    capacity = max(1, settings.prefix_chars // CHARS_PER_CHUNK)
    state: dict[str, Router] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(limits=limits, timeout=settings.request_timeout) as http:
            health_headers = {}
            if settings.worker_api_key is not None:
                health_headers["authorization"] = f"Bearer {settings.worker_api_key}"
            pool = WorkerPool(
                policy,
                http,
                capacity_chunks=capacity,
                health_interval=settings.health_interval,
                failure_threshold=settings.health_failure_threshold,
                headers=health_headers,
            )
            for url in settings.worker_urls:
                worker = await pool.add(url)
                if not worker.healthy:
                    logger.warning("worker %s is not healthy yet; it joins once /health answers 200", url)
            state["router"] = Router(settings, pool)
            registry = CollectorRegistry()
            registry.register(_RouterCollector(pool))  # type: ignore[arg-type]
            app.state.registry = registry
            pool.start()
            try:
                yield
            finally:
                await pool.stop()

    app = FastAPI(title="tokenmill router", lifespan=lifespan)

    def router() -> Router:
        return state["router"]

    async def dispatch(request: Request) -> Response:
        return await router().dispatch(request)

    async def pass_through(request: Request) -> Response:
        return await router().pass_through(request)

    for path in DISPATCHED_ROUTES:
        app.add_api_route(path, dispatch, methods=["POST"])
    for path in (*PASSED_ROUTES, "/v1/models/{model_id:path}"):
        app.add_api_route(path, pass_through, methods=["GET"])

    @app.get("/health")
    async def health() -> Response:
        if router().pool.healthy:
            return Response(status_code=200)
        return error_response(503, "no healthy worker is available", "no_healthy_worker")

    @app.get("/workers")
    @app.get("/list_workers")
    async def list_workers() -> dict[str, Any]:
        pool = router().pool
        workers = [
            {
                "url": w.url,
                "healthy": w.healthy,
                "requests": policy.loads.get(w.url, 0),
                "dispatched": w.dispatched,
            }
            for w in pool.workers.values()
        ]
        return {"workers": workers, "urls": [w.url for w in pool.workers.values()], "policy": policy.name}

    @app.post("/workers")
    @app.post("/add_worker")
    async def add_worker(request: Request) -> Response:
        url = request.query_params.get("url")
        if url is None:
            try:
                body = json.loads(await request.body() or b"{}")
            except ValueError:
                body = None
            url = body.get("url") if isinstance(body, dict) else None
        if not isinstance(url, str):
            return error_response(
                400, 'give the worker as {"url": "http://host:port"} or ?url=', "missing_url"
            )
        try:
            worker = await router().pool.add(url)
        except ValueError as exc:
            return error_response(400, str(exc), "invalid_url")
        return JSONResponse({"url": worker.url, "healthy": worker.healthy})

    @app.delete("/workers/{url:path}")
    async def delete_worker(url: str) -> Response:
        return _remove(url)

    @app.post("/remove_worker")
    async def remove_worker(request: Request) -> Response:
        return _remove(request.query_params.get("url", ""))

    def _remove(url: str) -> Response:
        try:
            removed = router().pool.remove(url)
        except ValueError as exc:
            return error_response(400, str(exc), "invalid_url")
        if not removed:
            return error_response(404, f"no worker {normalize_url(url)}", "worker_not_found")
        return JSONResponse({"removed": normalize_url(url)})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)

    if settings.api_keys:
        app.add_middleware(_APIKeyGuard, api_keys=settings.api_keys)
    return app
