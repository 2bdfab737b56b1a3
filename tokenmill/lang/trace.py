"""A record of every model call a program made, and its rendering as an HTML timeline."""

from __future__ import annotations

import html
import threading
import time
from dataclasses import dataclass


@dataclass
class CallRecord:
    """One model call: which state (lane) made it, what kind, when, and its token counts."""

    lane: str
    kind: str  # gen | select | prime | tool
    name: str | None
    start: float
    end: float
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def latency(self) -> float:
        return self.end - self.start


class Trace:
    """Thread-safe list of ``CallRecord``s shared by a program's state and its forks."""

    def __init__(self) -> None:
        self._records: list[CallRecord] = []
        self._lock = threading.Lock()

    def add(self, record: CallRecord) -> None:
        with self._lock:
            self._records.append(record)

    @property
    def records(self) -> list[CallRecord]:
        with self._lock:
            return sorted(self._records, key=lambda r: r.start)

    def totals(self) -> dict[str, float]:
        """Calls, prompt / cached / completion tokens, the cached share of prompt tokens, wall time."""
        records = self.records
        prompt = sum(r.prompt_tokens for r in records)
        cached = sum(r.cached_tokens for r in records)
        span = (max(r.end for r in records) - min(r.start for r in records)) if records else 0.0
        return {
            "calls": len(records),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "completion_tokens": sum(r.completion_tokens for r in records),
            "cached_share": cached / prompt if prompt else 0.0,
            "seconds": span,
        }

    def to_html(self) -> str:
        """A self-contained HTML page: one row per state, one bar per call (hover for the numbers)."""
        records = self.records
        if not records:
            return "<html><body><p>no model calls</p></body></html>"
        t0 = min(r.start for r in records)
        span = max(max(r.end for r in records) - t0, 1e-9)
        lanes = sorted({r.lane for r in records}, key=lambda lane: [int(p) for p in lane.split(".")])
        colors = {"gen": "#4c78a8", "select": "#f58518", "prime": "#54a24b", "tool": "#b279a2"}
        rows = []
        for lane in lanes:
            bars = []
            for r in (r for r in records if r.lane == lane):
                left = 100 * (r.start - t0) / span
                width = max(100 * r.latency / span, 0.3)
                tip = (
                    f"{r.kind} {r.name or ''}: {r.latency * 1000:.0f} ms, prompt {r.prompt_tokens} "
                    f"(cached {r.cached_tokens}), completion {r.completion_tokens}"
                    + (f", error: {r.error}" if r.error else "")
                )
                bars.append(
                    f'<div class="bar" title="{html.escape(tip)}" style="left:{left:.2f}%;width:{width:.2f}%;'
                    f'background:{colors.get(r.kind, "#888")}">{html.escape(r.name or r.kind)}</div>'
                )
            rows.append(
                f'<div class="row"><span class="lane">state {lane}</span><div class="track">{"".join(bars)}</div></div>'
            )
        totals = self.totals()
        summary = (
            f"{totals['calls']} calls in {totals['seconds']:.2f} s; prompt tokens {totals['prompt_tokens']:.0f} "
            f"({100 * totals['cached_share']:.0f}% cached), completion tokens {totals['completion_tokens']:.0f}"
        )
        style = (
            "body{font:13px sans-serif}.row{display:flex;align-items:center;margin:3px 0}"
            ".lane{width:90px}.track{position:relative;flex:1;height:20px;background:#f3f3f3}"
            ".bar{position:absolute;height:20px;color:#fff;overflow:hidden;white-space:nowrap;font-size:11px}"
        )
        return (
            f"<html><head><meta charset='utf-8'><style>{style}</style></head><body>"
            f"<p>{html.escape(summary)}</p>{''.join(rows)}</body></html>"
        )

    def save_html(self, path: str) -> None:
        """Write ``to_html()`` to ``path``."""
        with open(path, "w", encoding="utf-8") as out:
            out.write(self.to_html())


class CallTimer:
    """Times one call and records it: ``with CallTimer(trace, lane, kind, name) as t: t.done(result)``."""

    def __init__(self, trace: Trace, lane: str, kind: str, name: str | None) -> None:
        self.record = CallRecord(lane=lane, kind=kind, name=name, start=0.0, end=0.0)
        self.trace = trace

    def __enter__(self) -> CallTimer:
        self.record.start = time.perf_counter()
        return self

    def counts(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        self.record.prompt_tokens += prompt_tokens
        self.record.completion_tokens += completion_tokens
        self.record.cached_tokens += cached_tokens

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.record.end = time.perf_counter()
        if exc is not None:
            self.record.error = f"{type(exc).__name__}: {exc}"
        self.trace.add(self.record)
