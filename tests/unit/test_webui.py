"""The web UI's server side: pages, files and headers, ``--no-webui``, the API key around them, and
the numbers behind ``/metrics.json``. The app is built without its lifespan (no engine): the pages
need none; the browser tests (tests/e2e/test_webui_*.py) drive them against a live server."""

from __future__ import annotations

import argparse
import re
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from starlette.routing import NoMatchFound

from tokenmill.frontend.async_llm import EngineStats
from tokenmill.server.app import build_app
from tokenmill.server.cli_args import add_serve_args, settings_from_args
from tokenmill.server.live_metrics import LatencyWindow, metrics_snapshot, percentile
from tokenmill.server.settings import ServerSettings
from tokenmill.server.webui import CONTENT_SECURITY_POLICY, read_asset


def client(**settings: Any) -> TestClient:
    app = build_app(ServerSettings(model="m", **settings), config=None)  # type: ignore[arg-type]
    return TestClient(app)


def test_pages_and_files_are_served_with_a_strict_policy() -> None:
    http = client()
    for path, kind in [
        ("/", "text/html"),
        ("/dashboard", "text/html"),
        ("/webui/chat.js", "text/javascript"),
        ("/webui/markdown.js", "text/javascript"),
        ("/webui/style.css", "text/css"),
        ("/webui/favicon.svg", "image/svg+xml"),
    ]:
        response = http.get(path)
        assert response.status_code == 200, path
        assert response.headers["content-type"].startswith(kind)
        assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert response.headers["x-content-type-options"] == "nosniff"
    assert "script-src 'self';" in CONTENT_SECURITY_POLICY and "unsafe" not in CONTENT_SECURITY_POLICY
    assert (
        "connect-src 'self'" in CONTENT_SECURITY_POLICY
        and "frame-ancestors 'none'" in CONTENT_SECURITY_POLICY
    )


@pytest.mark.parametrize("name", ["nope.js", "..%2Fapp.py", "chat.html", "CHAT.JS", ".hidden.js", "x.py"])
def test_only_the_shipped_files_are_served(name: str) -> None:
    response = client().get("/webui/" + name)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


def test_the_pages_hold_no_inline_script_and_fetch_nothing_from_elsewhere() -> None:
    for page in ("chat.html", "dashboard.html"):
        html = read_asset(page).decode()
        scripts = re.findall(r"<script([^>]*)>(.*?)</script>", html, re.S)
        assert scripts and all('src="/webui/' in attrs and not body.strip() for attrs, body in scripts)
        assert not re.search(r"\son[a-z]+=", html)  # no inline event handlers
        assert not re.search(r"(src|href)=\"(https?:)?//", html)  # nothing from another origin
    for asset in ("chat.js", "dashboard.js", "charts.js", "api.js", "markdown.js", "style.css"):
        text = read_asset(asset).decode()
        assert "http://" not in text and "https://" not in text.replace("https?:", ""), asset
        assert "eval(" not in text and "new Function" not in text, asset


def test_no_webui_leaves_the_pages_out_but_keeps_metrics_json() -> None:
    http = client(webui=False)
    for path in ("/", "/dashboard", "/webui/chat.js"):
        assert http.get(path).status_code == 404
    app = http.app
    assert app.url_path_for("metrics_json") == "/metrics.json"  # type: ignore[attr-defined]
    with pytest.raises(NoMatchFound):
        app.url_path_for("chat_page")  # type: ignore[attr-defined]


def test_with_an_api_key_the_pages_are_open_and_what_they_call_is_guarded() -> None:
    http = client(api_keys=["k"])
    assert http.get("/").status_code == 200
    assert http.get("/webui/chat.js").status_code == 200
    for path in ("/metrics.json", "/v1/models", "/metrics"):
        response = http.get(path)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    closed = client(api_keys=["k"], webui=False)
    assert closed.get("/").status_code == 401  # without the web UI nothing but /health is open
    assert closed.get("/webui/chat.js").status_code == 401


def test_no_webui_flag() -> None:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert settings_from_args(parser.parse_args(["m"])).webui is True
    assert settings_from_args(parser.parse_args(["m", "--no-webui"])).webui is False


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0 and percentile(values, 0.99) == 99.0
    assert percentile(values, 1.0) == 100.0 and percentile([7.0], 0.99) == 7.0
    with pytest.raises(ValueError, match="percentile of no values"):
        percentile([], 0.5)


def test_latency_window_keeps_the_last_minute_by_tier() -> None:
    now = [1000.0]
    window = LatencyWindow(window_s=60.0, max_samples=50, clock=lambda: now[0])
    window.add(9.0, "default")  # old: gone by the time of the summary
    now[0] += 30.0
    for i in range(1, 101):
        window.add(i / 100, "default")  # only the newest 50 are kept
    window.add(0.2, "priority")
    now[0] += 40.0
    summary = window.summary()
    assert summary["default"] == {"p50": 0.75, "p99": 1.0, "count": 50}
    assert summary["priority"] == {"p50": 0.2, "p99": 0.2, "count": 1}
    now[0] += 61.0
    assert window.summary() == {}


def test_metrics_snapshot_reports_the_engine_stats() -> None:
    stats = EngineStats(
        num_running=3,
        num_waiting=2,
        kv_cache_usage=0.25,
        num_preemptions=4,
        prefix_cache_queried_tokens=200,
        prefix_cache_hit_tokens=50,
        generation_tokens=1234,
        overloaded_by_tier={"flex": 5, "default": 1},
        num_running_by_tier={"default": 3},
    )
    engine = SimpleNamespace(stats=stats, is_alive=True)
    window = LatencyWindow(clock=lambda: 0.0)
    window.add(0.5, "default")
    kv = {"free_blocks": 10}
    snapshot = metrics_snapshot(engine, "tiny", window, kv)  # type: ignore[arg-type]
    assert snapshot["num_running"] == 3 and snapshot["num_waiting"] == 2
    assert snapshot["kv_cache_usage"] == 0.25 and snapshot["prefix_cache_hit_rate"] == 0.25
    assert snapshot["num_overloaded"] == 6 and snapshot["num_preemptions"] == 4
    assert snapshot["generation_tokens"] == 1234 and snapshot["num_running_by_tier"] == {"default": 3}
    assert snapshot["ttft_by_tier"] == {"default": {"p50": 0.5, "p99": 0.5, "count": 1}}
    assert snapshot["kv"] == kv and snapshot["model"] == "tiny" and snapshot["engine_alive"] is True
    empty = metrics_snapshot(SimpleNamespace(stats=EngineStats(), is_alive=False), "tiny", window, None)  # type: ignore[arg-type]
    assert empty["prefix_cache_hit_rate"] == 0.0 and empty["kv"] is None
