"""The numbers behind the live dashboard: ``GET /metrics.json``, a JSON twin of ``/metrics``.

``LatencyWindow`` keeps the time-to-first-token samples of the last minute by service tier, so the
dashboard shows today's p50/p99 rather than an average since start-up; ``metrics_snapshot`` puts
the frontend's ``EngineStats``, those percentiles and the engine's live KV block counts into one
JSON object. Counters stay cumulative: the browser turns two snapshots into rates (tok/s, 429/s).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tokenmill.frontend.async_llm import AsyncLLM

WINDOW_S = 60.0
MAX_SAMPLES_PER_TIER = 4096


def percentile(sorted_values: list[float], fraction: float) -> float:
    """Nearest-rank percentile of an ascending, non-empty list (``fraction`` in [0, 1])."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    rank = max(1, math.ceil(fraction * len(sorted_values)))
    return sorted_values[rank - 1]


class LatencyWindow:
    """Latency samples of the last ``window_s`` seconds, by service tier (at most
    ``max_samples`` per tier: the oldest go first)."""

    def __init__(
        self,
        window_s: float = WINDOW_S,
        max_samples: int = MAX_SAMPLES_PER_TIER,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s = window_s
        self.max_samples = max_samples
        self.clock = clock
        self.samples: dict[str, deque[tuple[float, float]]] = {}

    def add(self, seconds: float, service_tier: str) -> None:
        tier = self.samples.setdefault(service_tier, deque(maxlen=self.max_samples))
        tier.append((self.clock(), seconds))

    def summary(self) -> dict[str, dict[str, float | int]]:
        """``{tier: {"p50": s, "p99": s, "count": n}}`` over the window; tiers with no recent sample
        are left out."""
        oldest = self.clock() - self.window_s
        result: dict[str, dict[str, float | int]] = {}
        for tier, samples in sorted(self.samples.items()):
            while samples and samples[0][0] < oldest:
                samples.popleft()
            if samples:
                values = sorted(seconds for _, seconds in samples)
                result[tier] = {
                    "p50": percentile(values, 0.50),
                    "p99": percentile(values, 0.99),
                    "count": len(values),
                }
        return result


def metrics_snapshot(
    engine: AsyncLLM, model_name: str, ttft: LatencyWindow, kv: dict[str, Any] | None
) -> dict[str, Any]:
    """One dashboard sample. ``kv`` is the engine's ``kv_stats()`` (None when the engine is gone)."""
    stats = engine.stats
    queried = stats.prefix_cache_queried_tokens
    return {
        "time": time.time(),
        "model": model_name,
        "engine_alive": engine.is_alive,
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "num_running_by_tier": dict(stats.num_running_by_tier),
        "num_waiting_by_tier": dict(stats.num_waiting_by_tier),
        "kv_cache_usage": stats.kv_cache_usage,
        "prefix_cache_queried_tokens": queried,
        "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens,
        "prefix_cache_hit_rate": stats.prefix_cache_hit_tokens / queried if queried else 0.0,
        "prompt_tokens": stats.prompt_tokens,
        "cached_prompt_tokens": stats.cached_prompt_tokens,
        "generation_tokens": stats.generation_tokens,
        "num_preemptions": stats.num_preemptions,
        "num_overloaded": sum(stats.overloaded_by_tier.values()),
        "overloaded_by_tier": dict(stats.overloaded_by_tier),
        "finished_requests": dict(stats.finished_requests),
        "ttft_window_s": ttft.window_s,
        "ttft_by_tier": ttft.summary(),
        "kv": kv,
    }
