"""The serving benchmark client: streams requests at an OpenAI-compatible server and times them.

It speaks only the public OpenAI streaming protocol (``/v1/completions`` or ``/v1/chat/completions``
with ``stream: true``), so the same run can measure tokenmill, vLLM or llama.cpp's llama-server.
Requests arrive as a Poisson process of ``request_rate`` per second (all at once when infinite),
optionally capped at ``max_concurrency`` in flight. A request that fails (HTTP error, error chunk,
dropped connection, empty stream) is recorded with its message; it never stops the run.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm.asyncio import tqdm

from tokenmill.bench.datasets import BenchRequest
from tokenmill.bench.metrics import BenchMetrics, RequestResult, compute_metrics, inter_token_latencies


@dataclass
class BenchConfig:
    """How to send the requests. ``base_url`` is the server root (a trailing ``/v1`` is dropped)."""

    base_url: str
    model: str
    endpoint: str = "completions"  # or "chat"
    request_rate: float = math.inf
    max_concurrency: int | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    min_tokens_equal_max: bool = False  # send min_tokens = max_tokens: exact output lengths
    extra_body: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    timeout_s: float = 300.0
    num_warmups: int = 0
    seed: int = 0
    progress: bool = True


@dataclass
class BenchOutcome:
    results: list[RequestResult]
    duration_s: float
    metrics: BenchMetrics


def server_root(base_url: str) -> str:
    """``base_url`` without a trailing slash or ``/v1``: OpenAI clients are often given the latter."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def request_path(endpoint: str) -> str:
    if endpoint not in ("completions", "chat"):
        raise ValueError(f"endpoint must be 'completions' or 'chat', not {endpoint!r}")
    return "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"


def build_body(request: BenchRequest, config: BenchConfig) -> dict[str, Any]:
    """The JSON body of one streaming request. Only fields every target server knows are sent,
    plus ``ignore_eos`` / ``min_tokens`` (vLLM's names, also tokenmill's) when asked for."""
    body: dict[str, Any] = {
        "model": config.model,
        "max_tokens": request.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "chat":
        body["messages"] = request.chat_messages()
    else:
        body["prompt"] = request.completion_prompt()
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.min_tokens_equal_max:
        body["min_tokens"] = request.output_len
    body.update(config.extra_body)
    return body


def arrival_offsets(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """Send times in seconds after the start: 0 for all when the rate is infinite, else a Poisson
    process (exponential gaps of mean ``1 / request_rate``) whose first request goes at 0."""
    if request_rate <= 0:
        raise ValueError("request_rate must be positive (use inf for all at once)")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(request_rate)
    return offsets


def _error_text(payload: Any) -> str | None:
    """The message of an OpenAI-shaped (or vLLM's older flat) error object, if ``payload`` is one."""
    if not isinstance(payload, dict):
        return None
    error = payload.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or error)
    if isinstance(error, str):
        return error
    if payload.get("object") == "error":
        return str(payload.get("message"))
    return None


class StreamParser:
    """Follows one SSE stream line by line and keeps what the metrics need.

    ``feed(line, now)`` takes each line of the body with its arrival time. A chunk counts as
    content when any choice carries non-empty ``text`` (completions) or ``delta.content`` /
    reasoning text (chat); role-only and usage-only chunks do not. ``finish_time`` is when a choice
    first carried a ``finish_reason``: a model may end its answer at once (its first token the end of
    sequence), and that empty answer is a completed request, as vLLM's benchmark counts it.
    """

    def __init__(self) -> None:
        self.content_times: list[float] = []
        self.finish_time: float | None = None
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        self.done = False
        self.last_time: float | None = None

    def feed(self, line: str, now: float) -> None:
        if not line.startswith("data:"):
            return  # blank separators, comments and event names carry nothing we time
        data = line[len("data:") :].strip()
        self.last_time = now
        if data == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            self.error = self.error or f"undecodable stream chunk: {data[:200]}"
            return
        message = _error_text(chunk)
        if message is not None:
            self.error = self.error or f"error in stream: {message}"
            return
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if any(_choice_text(choice) for choice in choices):
            self.content_times.append(now)
        if self.finish_time is None and any(isinstance(c, dict) and c.get("finish_reason") for c in choices):
            self.finish_time = now


def _choice_text(choice: Any) -> str:
    if not isinstance(choice, dict):
        return ""
    if isinstance(choice.get("text"), str):
        return str(choice["text"])
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return ""
    return "".join(str(delta.get(k) or "") for k in ("content", "reasoning_content", "reasoning"))


def _http_error(status: int, body: bytes) -> str:
    text = body.decode("utf-8", errors="replace")
    try:
        message = _error_text(json.loads(text))
    except json.JSONDecodeError:
        message = None
    return f"HTTP {status}: {message if message is not None else text[:200]}"


def finish_result(request: BenchRequest, parser: StreamParser, sent: float, ended: float) -> RequestResult:
    """Turn a parsed stream into a result. Usage counts win over chunk counts and dataset lengths."""
    result = RequestResult(prompt_len=request.prompt_len, e2e=ended - sent)
    usage = parser.usage or {}
    if isinstance(usage.get("prompt_tokens"), int):
        result.prompt_len = usage["prompt_tokens"]
    completion = usage.get("completion_tokens")
    if parser.error is not None:
        result.error = parser.error
    elif not parser.content_times and parser.finish_time is not None:
        # An empty answer: its one token (the end of sequence) arrived with the finish.
        result.ttft = parser.finish_time - sent
        result.output_tokens = completion if isinstance(completion, int) else 0
    elif not parser.content_times:
        result.error = "stream ended without output text"
    else:
        result.ttft = parser.content_times[0] - sent
        result.itl = inter_token_latencies(parser.content_times)
        result.output_tokens = completion if isinstance(completion, int) else len(parser.content_times)
    return result


async def send_request(
    client: httpx.AsyncClient, config: BenchConfig, request: BenchRequest, bench_start: float
) -> RequestResult:
    """Send one streaming request and time it. Never raises for a failed request (only on cancel)."""
    parser = StreamParser()
    sent = time.perf_counter()
    try:
        async with client.stream(
            "POST", request_path(config.endpoint), json=build_body(request, config)
        ) as r:
            if r.status_code != 200:
                result = RequestResult(prompt_len=request.prompt_len, e2e=time.perf_counter() - sent)
                result.error = _http_error(r.status_code, await r.aread())
                result.start = sent - bench_start
                return result
            # Read to the end even after [DONE] so the connection goes back to the pool.
            async for line in r.aiter_lines():
                parser.feed(line, time.perf_counter())
    except Exception as exc:  # one broken request must not end the benchmark
        detail = str(exc)
        parser.error = parser.error or (f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__)
    ended = parser.last_time if parser.last_time is not None else time.perf_counter()
    result = finish_result(request, parser, sent, ended)
    result.start = sent - bench_start
    return result


def _client(config: BenchConfig) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # No pool cap unless a concurrency cap is asked for: queueing for a connection inside the client
    # would be counted as server latency. A connection per request, none kept alive (as vLLM's and
    # SGLang's benchmark clients do): llama-server closes kept-alive connections after some requests
    # without a "Connection: close", and a request sent on one then fails with "Server disconnected
    # without sending a response" (3-11 of 128 in the shared-prefix benchmark, none this way).
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=0)
    return httpx.AsyncClient(
        base_url=server_root(config.base_url), headers=headers, timeout=config.timeout_s, limits=limits
    )


async def run_benchmark(config: BenchConfig, requests: Sequence[BenchRequest]) -> BenchOutcome:
    """Run the whole benchmark and summarize it.

    Warm-up requests (the first ``num_warmups`` of ``requests``, sent one by one) are not measured;
    if one fails, ``RuntimeError`` is raised, since a misconfigured run would only measure errors.
    """
    offsets = arrival_offsets(len(requests), config.request_rate, config.seed)
    semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    async with _client(config) as client:
        for request in list(requests)[: config.num_warmups]:
            warm = await send_request(client, config, request, time.perf_counter())
            if not warm.success:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
        bar = tqdm(total=len(requests), disable=not config.progress, desc="requests")
        start = time.perf_counter()

        async def one(request: BenchRequest, offset: float) -> RequestResult:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if semaphore is None:
                result = await send_request(client, config, request, start)
            else:
                async with semaphore:
                    result = await send_request(client, config, request, start)
            bar.update(1)
            return result

        results = list(await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets))))
        duration = time.perf_counter() - start
        bar.close()
    return BenchOutcome(results, duration, compute_metrics(results, duration))


def first_model(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> str:
    """The id of the first model the server lists at ``GET /v1/models``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{server_root(base_url)}/v1/models", headers=headers, timeout=timeout_s)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError("the server lists no models; pass --model")
    return str(models[0]["id"])
