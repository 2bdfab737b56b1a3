"""Per-replica metrics of a data-parallel server (``--data-parallel-size``), labelled ``replica``.

Read from ``AsyncLLM.replica_stats`` at scrape time; a server with one engine exports none.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tokenmill.frontend.async_llm import AsyncLLM

# name -> (kind, help, the ReplicaStats field)
_REPLICA_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("dp_replica_requests", "gauge", "Sequences sent to the replica that have not ended.", "in_flight"),
    ("dp_replica_dispatched", "counter", "Request groups sent to the replica.", "dispatched"),
    ("dp_replica_num_requests_running", "gauge", "Sequences running in the replica.", "num_running"),
    ("dp_replica_num_requests_waiting", "gauge", "Sequences waiting in the replica.", "num_waiting"),
    (
        "dp_replica_kv_cache_usage_perc",
        "gauge",
        "Fraction of the replica's KV blocks in use.",
        "kv_cache_usage",
    ),
    (
        "dp_replica_prefix_cache_queries",
        "counter",
        "Prompt tokens the replica looked up in its prefix cache.",
        "prefix_cache_queried_tokens",
    ),
    (
        "dp_replica_prefix_cache_hits",
        "counter",
        "Prompt tokens the replica's prefix cache served.",
        "prefix_cache_hit_tokens",
    ),
    (
        "dp_replica_predicted_hit_tokens",
        "counter",
        "Prompt tokens the dispatch index expected the replica to have cached.",
        "predicted_hit_tokens",
    ),
    ("dp_replica_engine_alive", "gauge", "1 while the replica's engine process serves, else 0.", "alive"),
)


def replica_metrics(engine: AsyncLLM, model_name: str) -> Iterator[Metric]:
    """One metric family per ``ReplicaStats`` number, a sample per replica."""
    stats = engine.replica_stats
    if not stats:
        return
    for name, kind, doc, attribute in _REPLICA_METRICS:
        family_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        family = family_type(f"tokenmill:{name}", doc, labels=["model_name", "replica"])
        for replica in stats:
            family.add_metric([model_name, replica.replica], float(getattr(replica, attribute)))
        yield family
