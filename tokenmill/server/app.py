"""The FastAPI app: OpenAI routes, tokenizer routes, health/version/metrics and admin routes.

``build_app`` wires the lifespan (engine process up before the first request, down on shutdown),
error handlers and middleware. Route bodies stay thin; the work lives in ``serving_*.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import tokenmill
from tokenmill.config import EngineConfig
from tokenmill.core.client import EngineProcessHandle, freeze_startup_objects
from tokenmill.frontend.async_llm import AsyncLLM, EngineDeadError
from tokenmill.loader import ModelSource
from tokenmill.server.context import ServerContext, get_context
from tokenmill.server.errors import APIError, bad_request, install_error_handlers
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.middleware import APIKeyMiddleware, RequestBodyMiddleware
from tokenmill.server.native_routes import native_router
from tokenmill.server.openai_extensions import check_unknown_fields, with_ignored_fields
from tokenmill.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from tokenmill.server.rl_routes import router as rl_router
from tokenmill.server.serving_chat import create_chat_completion, render_chat_prompt
from tokenmill.server.serving_completions import create_completion
from tokenmill.server.serving_lora import lora_model_cards, lora_router, refresh_lora_metrics
from tokenmill.server.settings import ServerSettings
from tokenmill.server.webui import install_webui, public_paths

Context = Annotated[ServerContext, Depends(get_context)]
router = APIRouter()


def _engine_unavailable(exc: Exception) -> APIError:
    return APIError(
        503, f"the engine is not available: {exc}", type="server_error", code="engine_unavailable"
    )


# ---------------------------------------------------------------------------------------------------
# OpenAI


@router.get("/v1/models")
async def list_models(ctx: Context) -> JSONResponse:
    cards = [
        ModelCard(id=name, max_model_len=ctx.engine.max_model_len) for name in ctx.settings.served_model_names
    ]
    cards += lora_model_cards(ctx)
    return JSONResponse(ModelList(data=cards).model_dump(mode="json"))


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, ctx: Context) -> JSONResponse:
    ctx.check_model(model_id)
    return JSONResponse(
        ModelCard(id=model_id, max_model_len=ctx.engine.max_model_len).model_dump(mode="json")
    )


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, raw: Request, ctx: Context) -> Response:
    ignored = check_unknown_fields(body, ctx.settings.unknown_fields)
    return with_ignored_fields(await create_chat_completion(body, raw, ctx), ignored)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, raw: Request, ctx: Context) -> Response:
    ignored = check_unknown_fields(body, ctx.settings.unknown_fields)
    return with_ignored_fields(await create_completion(body, raw, ctx), ignored)


# ---------------------------------------------------------------------------------------------------
# tokenizer


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, ctx: Context) -> dict[str, Any]:
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", param="prompt")
    if body.prompt is not None:
        token_ids = ctx.engine.input_processor.tokenize(body.prompt, body.add_special_tokens)
    else:
        assert body.messages is not None
        _, token_ids = render_chat_prompt(
            ctx, body.messages, add_generation_prompt=body.add_generation_prompt
        )
    return {"count": len(token_ids), "max_model_len": ctx.engine.max_model_len, "tokens": token_ids}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, ctx: Context) -> dict[str, Any]:
    ctx.check_model(body.model)
    vocab_size = ctx.engine.input_processor.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param="tokens")
    return {"prompt": ctx.engine.tokenizer.decode(body.tokens)}


# ---------------------------------------------------------------------------------------------------
# operations


@router.get("/health")
async def health(ctx: Context) -> Response:
    ctx.check_alive()
    return Response(status_code=200)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": tokenmill.__version__}


@router.get("/metrics")
async def metrics(ctx: Context) -> Response:
    await refresh_lora_metrics(ctx)
    body, content_type = ctx.metrics.render()
    return Response(body, media_type=content_type)


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(ctx: Context) -> dict[str, bool]:
    """Drop every cached KV block no request uses; ``success`` is false while requests hold some."""
    try:
        return {"success": await ctx.engine.reset_prefix_cache()}
    except EngineDeadError as exc:
        raise _engine_unavailable(exc) from None


@router.get("/v1/admin/kv")
async def admin_kv(ctx: Context) -> dict[str, Any]:
    """Live KV-cache numbers from the engine (free, cached and in-use blocks; queue lengths)."""
    try:
        return await ctx.engine.kv_stats()
    except EngineDeadError as exc:
        raise _engine_unavailable(exc) from None


@router.get("/v1/admin/engine")
async def admin_engine(ctx: Context) -> dict[str, Any]:
    """The engine process: pid, liveness and sizes (answers even when the engine is dead)."""
    engine = ctx.engine
    return {
        "pid": engine.engine_pid,
        "pids": engine.engine_pids,  # one per data-parallel replica
        "alive": engine.is_alive,
        "dead_reason": engine.dead_reason,
        "max_model_len": engine.max_model_len,
        "num_blocks": engine.num_blocks,
        "kv_cache_tokens": engine.num_blocks * engine.block_size,
        "kv_cache_bytes": engine.kv_cache_bytes,
        "deterministic": engine.config.deterministic,
    }


# ---------------------------------------------------------------------------------------------------
# the app


def build_app(
    settings: ServerSettings,
    config: EngineConfig,
    source: ModelSource | None = None,
    spawned: EngineProcessHandle | list[EngineProcessHandle] | None = None,
) -> FastAPI:
    """An app that starts the engine process in its lifespan (or attaches to ``spawned``, started
    earlier for ``config``: see ``AsyncLLM.start``) and stops it on shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = await AsyncLLM.start(
            config,
            source,
            log_requests=settings.log_requests,
            log_level=settings.log_level.upper(),
            start_timeout=settings.engine_start_timeout,
            spawned=spawned,
        )
        metrics = ServerMetrics(engine, settings.model_name)
        engine.listeners.append(metrics)
        app.state.ctx = ServerContext(engine, settings, metrics)
        freeze_startup_objects()  # this process streams every token: keep its collections short too
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="tokenmill", version=tokenmill.__version__, lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(native_router)  # SGLang's native API: /generate, /model_info, ...
    app.include_router(rl_router)  # weight updates, pause, memory release (RL)
    app.include_router(lora_router)  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    install_webui(app, settings.webui)  # /metrics.json; the chat page and dashboard unless --no-webui
    app.add_middleware(
        RequestBodyMiddleware, max_bytes=settings.max_request_body_bytes, read_timeout=settings.body_timeout
    )
    if settings.api_keys:
        # Added last, so it runs first: an unauthorized caller learns nothing, not even a 413.
        paths, prefixes = public_paths(settings.webui)  # the pages (no data) open; what they call guarded
        app.add_middleware(
            APIKeyMiddleware, api_keys=settings.api_keys, public_paths=paths, public_prefixes=prefixes
        )
    return app
