"""Presenting a serving benchmark: the printed table, the result JSON, and the latency-CDF plot."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tokenmill.bench.metrics import BenchMetrics, LatencyStats, RequestResult, tpot
from tokenmill.bench.serve import BenchConfig

_WIDTH = 64
LATENCIES = (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2e"))


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.2f}"


def _line(name: str, value: object) -> str:
    return f"{name:<40}{value!s:>{_WIDTH - 40}}"


def format_report(metrics: BenchMetrics, config: BenchConfig, title: str = "") -> str:
    """The human-readable summary printed at the end of a run."""
    header = f" Serving benchmark{': ' + title if title else ''} "
    concurrency = config.max_concurrency if config.max_concurrency else "unbounded"
    lines = [
        header.center(_WIDTH, "="),
        _line("Endpoint", f"{config.base_url} ({config.endpoint})"),
        _line("Model", config.model),
        _line("Request rate (req/s) / max concurrency", f"{config.request_rate} / {concurrency}"),
        _line("Successful requests", metrics.completed),
        _line("Failed requests", metrics.failed),
        _line("Benchmark duration (s)", f"{metrics.duration_s:.2f}"),
        _line("Total input tokens", metrics.total_input_tokens),
        _line("Total output tokens", metrics.total_output_tokens),
        _line("Request throughput (req/s)", f"{metrics.request_throughput:.2f}"),
        _line("Output token throughput (tok/s)", f"{metrics.output_throughput:.2f}"),
        _line("Total token throughput (tok/s)", f"{metrics.total_token_throughput:.2f}"),
        _line("Peak concurrent requests", metrics.peak_concurrency),
        " Latency (ms) ".center(_WIDTH, "-"),
        f"{'':<8}{'mean':>14}{'p50':>14}{'p90':>14}{'p99':>14}",
    ]
    for label, name in LATENCIES:
        stats: LatencyStats = getattr(metrics, name)
        values = (stats.mean, stats.p50, stats.p90, stats.p99)
        lines.append(f"{label:<8}" + "".join(f"{_ms(v):>14}" for v in values))
    if metrics.errors:
        lines.append(" Failures ".center(_WIDTH, "-"))
        for message, count in list(metrics.errors.items())[:5]:
            lines.append(f"{count:>6} x {message[: _WIDTH * 2]}")
        if len(metrics.errors) > 5:
            lines.append(f"   ... and {len(metrics.errors) - 5} other messages (all in the result JSON)")
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as null (an infinite request rate as the string)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def result_document(
    metrics: BenchMetrics, config: BenchConfig, results: Sequence[RequestResult], dataset: dict[str, Any]
) -> dict[str, Any]:
    """Everything about a run as plain JSON data: configuration, summary, and every request."""
    settings = {k: v for k, v in asdict(config).items() if k != "api_key"}
    settings["request_rate"] = (
        str(config.request_rate) if math.isinf(config.request_rate) else config.request_rate
    )
    per_request = [
        {
            "start_s": r.start,
            "prompt_len": r.prompt_len,
            "output_tokens": r.output_tokens,
            "ttft_s": r.ttft,
            "tpot_s": tpot(r.e2e, r.ttft, r.output_tokens)
            if r.e2e is not None and r.ttft is not None
            else None,
            "e2e_s": r.e2e,
            "itl_s": r.itl,
            "error": r.error,
        }
        for r in results
    ]
    document = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": settings,
        "dataset": dataset,
        "metrics": metrics.to_dict(),
        "requests": per_request,
    }
    return dict(_finite(document))


def write_result_json(path: str | Path, document: dict[str, Any]) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n", encoding="utf-8")


def plot_latency_cdfs(results: Sequence[RequestResult], path: str | Path, title: str = "") -> None:
    """Write a PNG of the empirical CDFs of TTFT, TPOT, ITL and E2E over successful requests.

    Uses matplotlib's object API on an Agg canvas (no pyplot state, no display needed); raises
    ``ImportError`` when matplotlib is not installed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    done = [r for r in results if r.success]
    samples = {
        "TTFT": [r.ttft for r in done if r.ttft is not None],
        "TPOT": [
            t
            for r in done
            if r.e2e is not None
            and r.ttft is not None
            and (t := tpot(r.e2e, r.ttft, r.output_tokens)) is not None
        ],
        "ITL": [gap for r in done for gap in r.itl],
        "E2E": [r.e2e for r in done if r.e2e is not None],
    }
    figure = Figure(figsize=(10, 7), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, 2)
    for ax, (name, values) in zip(axes.flat, samples.items()):
        ordered = sorted(v * 1000 for v in values)
        if ordered:
            fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
            ax.step(ordered, fractions, where="post")
        else:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{name} ({len(ordered)} samples)")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
    figure.suptitle(f"Latency CDFs{': ' + title if title else ''}")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, format="png", dpi=100)
