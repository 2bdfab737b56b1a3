"""Prometheus metrics for ``GET /metrics``; every name starts with ``tokenmill:``.

Gauges and counters are read from ``AsyncLLM.stats`` at scrape time (one source of truth, no
double bookkeeping); latency histograms are fed as events happen, through the ``StatsListener``
hooks. Each server gets its own registry, so several apps can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tokenmill.frontend.async_llm import AsyncLLM, FinishedRequestStats
from tokenmill.server.dp_metrics import replica_metrics
from tokenmill.server.live_metrics import LatencyWindow

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)


class _EngineCollector:
    """Exports the engine's gauges and the frontend's counters from ``AsyncLLM.stats``."""

    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine = engine
        self.labels = [model_name]

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        metric = GaugeMetricFamily(f"tokenmill:{name}", doc, labels=["model_name"])
        metric.add_metric(self.labels, value)
        return metric

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        metric = CounterMetricFamily(f"tokenmill:{name}", doc, labels=["model_name"])
        metric.add_metric(self.labels, value)
        return metric

    def _by_tier(
        self,
        family: type[GaugeMetricFamily] | type[CounterMetricFamily],
        name: str,
        doc: str,
        values: dict[str, int],
    ) -> Metric:
        metric = family(f"tokenmill:{name}", doc, labels=["model_name", "service_tier"])
        for tier, value in sorted(values.items()):
            metric.add_metric([*self.labels, tier], value)
        return metric

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats
        yield self._gauge("num_requests_running", "Sequences running in the engine.", stats.num_running)
        yield self._gauge("num_requests_waiting", "Sequences waiting to be scheduled.", stats.num_waiting)
        yield self._gauge(
            "kv_cache_usage_perc", "Fraction of KV blocks held by requests (0 to 1).", stats.kv_cache_usage
        )
        yield self._gauge(
            "engine_alive", "1 while the engine process serves, else 0.", float(self.engine.is_alive)
        )
        yield self._counter(
            "num_preemptions", "Sequences preempted to free KV blocks.", stats.num_preemptions
        )
        yield self._counter("prompt_tokens", "Prompt tokens of accepted requests.", stats.prompt_tokens)
        yield self._counter(
            "cached_prompt_tokens", "Prompt tokens served from the prefix cache.", stats.cached_prompt_tokens
        )
        yield self._counter("generation_tokens", "Tokens generated.", stats.generation_tokens)
        yield self._counter(
            "prefix_cache_queries",
            "Tokens looked up in the prefix cache at admission.",
            stats.prefix_cache_queried_tokens,
        )
        yield self._counter(
            "prefix_cache_hits", "Tokens the prefix cache served at admission.", stats.prefix_cache_hit_tokens
        )
        yield self._counter(
            "jump_forward_tokens",
            "Output tokens a grammar forced, appended without sampling (jump-forward).",
            stats.jump_forward_tokens,
        )
        yield self._counter(
            "spec_decode_num_draft_tokens",
            "Speculative draft tokens verified by the target model.",
            stats.spec_num_draft_tokens,
        )
        yield self._counter(
            "spec_decode_num_accepted_tokens",
            "Speculative draft tokens the target model accepted.",
            stats.spec_num_accepted_tokens,
        )
        per_position = CounterMetricFamily(
            "tokenmill:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by draft position (0: a step's first draft).",
            labels=["model_name", "position"],
        )
        for position, count in enumerate(stats.spec_accepted_per_position):
            per_position.add_metric([*self.labels, str(position)], count)
        yield per_position
        queried = stats.prefix_cache_queried_tokens
        yield self._gauge(
            "prefix_cache_hit_rate",
            "Prefix-cache hits over queries since start-up (0 before any query).",
            stats.prefix_cache_hit_tokens / queried if queried else 0.0,
        )
        yield self._by_tier(
            GaugeMetricFamily,
            "num_requests_running_by_tier",
            "Sequences running, by service tier.",
            stats.num_running_by_tier,
        )
        yield self._by_tier(
            GaugeMetricFamily,
            "num_requests_waiting_by_tier",
            "Sequences waiting, by service tier.",
            stats.num_waiting_by_tier,
        )
        yield self._by_tier(
            CounterMetricFamily,
            "num_requests_overloaded",
            "Requests refused with 429 because a waiting queue was full, by service tier.",
            stats.overloaded_by_tier,
        )
        finished = CounterMetricFamily(
            "tokenmill:request_success",
            "Requests that ended, by finish reason.",
            labels=["model_name", "finished_reason"],
        )
        for reason, count in sorted(stats.finished_requests.items()):
            finished.add_metric([*self.labels, reason], count)
        yield finished
        yield from replica_metrics(self.engine, self.labels[0])


class ServerMetrics:
    """The server's registry; register it on the engine with ``engine.listeners.append(metrics)``."""

    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(_EngineCollector(engine, model_name))  # type: ignore[arg-type]
        self.ttft = Histogram(
            "tokenmill:time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            ["model_name", "service_tier"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "tokenmill:inter_token_latency_seconds",
            "Time between consecutive tokens of one sequence.",
            ["model_name", "service_tier"],
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "tokenmill:e2e_request_latency_seconds",
            "Time from arrival to the end of the request.",
            ["model_name", "service_tier"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.recent_ttft = LatencyWindow()  # the last minute's TTFTs, for the dashboard's percentiles

    # StatsListener: latencies are labelled by service tier, so each tier's targets can be watched.
    def on_first_token(self, seconds: float, service_tier: str) -> None:
        self.ttft.labels(self.model_name, service_tier).observe(seconds)
        self.recent_ttft.add(seconds, service_tier)

    def on_inter_token(self, seconds: float, service_tier: str) -> None:
        self.itl.labels(self.model_name, service_tier).observe(seconds)

    def on_request_finished(self, stats: FinishedRequestStats) -> None:
        self.e2e.labels(self.model_name, stats.service_tier).observe(stats.e2e_latency)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
