"""Serving-benchmark metrics: pure functions from per-request timings to a summary.

Nothing here does I/O or reads a clock, so every number in a benchmark report can be checked
against hand-made timings. Times are in seconds; the report layer converts to milliseconds.

Definitions (the ones vLLM and SGLang also use, so reports are comparable across engines):

- TTFT: request sent -> first chunk carrying output text.
- ITL: time between consecutive content chunks of one request (pooled over all requests).
- TPOT: ``(e2e - ttft) / (output_tokens - 1)``, per request, defined only when output_tokens > 1.
  It differs from the mean ITL when a server packs several tokens into one chunk.
- E2E: request sent -> last byte of the response.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """What one benchmark request measured. ``success`` is False exactly when ``error`` is set."""

    prompt_len: int  # prompt tokens: the server's usage count when reported, else the dataset's
    output_tokens: int = 0  # usage.completion_tokens when reported, else the number of content chunks
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    start: float = 0.0  # send time relative to the benchmark's start
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None


def tpot(e2e: float, ttft: float, output_tokens: int) -> float | None:
    """Time per output token after the first; None when fewer than two tokens came back."""
    if output_tokens < 2:
        return None
    return (e2e - ttft) / (output_tokens - 1)


def inter_token_latencies(chunk_times: Sequence[float]) -> list[float]:
    """Gaps between consecutive content-chunk arrival times (which must be non-decreasing)."""
    return [later - earlier for earlier, later in zip(chunk_times, chunk_times[1:])]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks; values non-empty."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def peak_concurrency(intervals: Sequence[tuple[float, float]]) -> int:
    """Most (start, end) intervals open at one instant; an interval ending as another starts does
    not overlap it."""
    events = sorted([(end, -1) for _, end in intervals] + [(start, 1) for start, _ in intervals])
    peak = level = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


@dataclass
class LatencyStats:
    """Summary of one latency distribution, in seconds. All None when there were no samples."""

    count: int
    mean: float | None
    std: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> LatencyStats:
        if not values:
            return cls(0, None, None, None, None, None, None)
        array = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = (percentile(values, q) for q in PERCENTILES)
        return cls(len(values), float(array.mean()), float(array.std()), p50, p90, p99, float(array.max()))

    def in_ms(self) -> dict[str, float | int | None]:
        """The same summary with every time in milliseconds (count unchanged), for reports and JSON."""
        out: dict[str, float | int | None] = {"count": self.count}
        for key, value in asdict(self).items():
            if key != "count":
                out[key] = None if value is None else value * 1000.0
        return out


@dataclass
class BenchMetrics:
    """The benchmark's summary. Throughputs count completed requests only, over the whole duration."""

    num_requests: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    peak_concurrency: int  # most requests in flight at once, failed ones included
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    errors: dict[str, int]  # error message -> how many requests failed with it

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("ttft", "tpot", "itl", "e2e")}
        for name in ("ttft", "tpot", "itl", "e2e"):
            out[f"{name}_ms"] = getattr(self, name).in_ms()
        return out


def _rate(amount: float, duration_s: float) -> float:
    return amount / duration_s if duration_s > 0 else math.nan


def compute_metrics(results: Sequence[RequestResult], duration_s: float) -> BenchMetrics:
    """Summarize per-request results measured over ``duration_s`` seconds of wall time.

    Failed requests count towards ``failed`` and ``errors`` only: their partial timings would bias
    the latency distributions and their tokens were not served.
    """
    done = [r for r in results if r.success]
    ttfts = [r.ttft for r in done if r.ttft is not None]
    e2es = [r.e2e for r in done if r.e2e is not None]
    tpots = [
        t
        for r in done
        if r.e2e is not None
        and r.ttft is not None
        and (t := tpot(r.e2e, r.ttft, r.output_tokens)) is not None
    ]
    itls = [gap for r in done for gap in r.itl]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    errors = Counter(r.error for r in results if r.error is not None)
    return BenchMetrics(
        num_requests=len(results),
        completed=len(done),
        failed=len(results) - len(done),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=_rate(len(done), duration_s),
        output_throughput=_rate(output_tokens, duration_s),
        total_token_throughput=_rate(input_tokens + output_tokens, duration_s),
        peak_concurrency=peak_concurrency([(r.start, r.start + r.e2e) for r in results if r.e2e is not None]),
        ttft=LatencyStats.of(ttfts),
        tpot=LatencyStats.of(tpots),
        itl=LatencyStats.of(itls),
        e2e=LatencyStats.of(e2es),
        errors=dict(errors.most_common()),
    )
