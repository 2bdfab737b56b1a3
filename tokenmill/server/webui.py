"""The browser pages: the chat playground at ``GET /``, the live dashboard at ``GET /dashboard``, their
static files under ``/webui/``, and the JSON metrics they poll (``GET /metrics.json``).

The pages are plain HTML, CSS and JavaScript shipped in ``server/webui_assets/`` (package data):
no build step, no CDN, nothing fetched from elsewhere at run time. Every page and file goes out with
a Content-Security-Policy that allows scripts and styles from this origin's files only (no inline
script, no ``eval``), network calls to this origin only, and no framing, so text a model writes can
never run as code even if a renderer bug let markup through.

The pages and their files are public (a browser cannot send a bearer token when it opens a URL; they
hold no data); everything they call (``/v1/...``, ``/metrics.json``) stays behind ``--api-key``, and
the page asks for the key. ``--no-webui`` leaves the pages out; ``/metrics.json`` stays.
"""

from __future__ import annotations

import re
from importlib import resources
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI
from starlette.responses import JSONResponse, Response

from tokenmill.frontend.async_llm import EngineDeadError
from tokenmill.server.context import ServerContext, get_context
from tokenmill.server.errors import APIError
from tokenmill.server.live_metrics import metrics_snapshot

Context = Annotated[ServerContext, Depends(get_context)]

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
ASSET_PREFIX = "/webui/"
PAGES = {"/": "chat.html", "/dashboard": "dashboard.html"}
_CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
_ASSET_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*\.(js|css|svg)$")


def public_paths(webui: bool) -> tuple[frozenset[str], tuple[str, ...]]:
    """Paths (exact, and prefixes) the API key does not guard: the pages and their files."""
    return (frozenset(PAGES), (ASSET_PREFIX,)) if webui else (frozenset(), ())


def read_asset(name: str) -> bytes:
    """The bytes of a file in ``webui_assets``; ``FileNotFoundError`` if there is none."""
    return resources.files("tokenmill.server").joinpath("webui_assets", name).read_bytes()


def _asset_response(name: str) -> Response:
    body = read_asset(name)
    media_type = _CONTENT_TYPES[name[name.rindex(".") :]]
    return Response(body, media_type=media_type, headers=PAGE_HEADERS)


pages_router = APIRouter(include_in_schema=False)
metrics_router = APIRouter()


@pages_router.get("/")
async def chat_page() -> Response:
    return _asset_response(PAGES["/"])


@pages_router.get("/dashboard")
async def dashboard_page() -> Response:
    return _asset_response(PAGES["/dashboard"])


@pages_router.get(ASSET_PREFIX + "{name}")
async def asset(name: str) -> Response:
    if _ASSET_NAME.match(name):
        try:
            return _asset_response(name)
        except FileNotFoundError:
            pass
    raise APIError(404, f"no web UI file named {name!r}", code="not_found")


@metrics_router.get("/metrics.json")
async def metrics_json(ctx: Context) -> JSONResponse:
    """What ``/metrics`` says, as one JSON object, plus the last minute's TTFT percentiles by tier and
    the engine's live KV block counts (``kv`` is null when the engine is gone)."""
    kv: dict[str, Any] | None
    try:
        kv = await ctx.engine.kv_stats() if ctx.engine.is_alive else None
    except EngineDeadError:
        kv = None
    snapshot = metrics_snapshot(ctx.engine, ctx.model_name, ctx.metrics.recent_ttft, kv)
    snapshot["service_tiers"] = [tier.name for tier in ctx.engine.config.scheduler.tiers]
    return JSONResponse(snapshot, headers={"Cache-Control": "no-store"})


def install_webui(app: FastAPI, webui: bool) -> None:
    """Add ``/metrics.json`` and, unless ``webui`` is false (``--no-webui``), the pages."""
    app.include_router(metrics_router)
    if webui:
        app.include_router(pages_router)
