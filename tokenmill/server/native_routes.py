"""SGLang's native HTTP routes beside the OpenAI ones (same app, same API key):

- ``POST /generate`` (``serving_generate.py``);
- ``GET /model_info`` and ``/get_model_info``: ``model_path``, ``tokenizer_path``, ``is_generation``...;
- ``GET /get_load``: running and waiting requests and KV tokens in use (SGLang's router polls it);
- ``GET /server_info`` and ``/get_server_info``: the server's settings and the engine's configuration
  and sizes as JSON (never the API keys);
- ``GET /health_generate``: 200 once a one-token generation went through, 503 when it cannot;
- ``POST /flush_cache`` (GET too, as SGLang): empties the prefix cache; 400 while requests hold
  cached blocks;
- ``POST /abort_request {"rid"}``: ends the requests running under ``rid`` (or a batch's items
  ``rid_<i>``; ``abort_all`` ends every request), whose answers then end with finish reason ``abort``
  and the output produced so far;
- ``POST /encode``: SGLang's embedding route; tokenmill serves generation models, so a 400 says so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from typing import Annotated, Any

from fastapi import APIRouter, Depends
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import tokenmill
from tokenmill.frontend.async_llm import EngineDeadError
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.context import ServerContext, get_context
from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.native_protocol import AbortRequest, FlushCacheRequest, GenerateRequest
from tokenmill.server.serving_generate import create_generate

Context = Annotated[ServerContext, Depends(get_context)]
native_router = APIRouter()

# How long /health_generate waits for its one token before it calls the engine unhealthy.
HEALTH_GENERATE_TIMEOUT_S = 20.0


def _unavailable(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="engine_unavailable")


@native_router.post("/generate")
async def generate(body: GenerateRequest, raw: Request, ctx: Context) -> Response:
    return await create_generate(body, raw, ctx)


def model_info(ctx: ServerContext) -> dict[str, Any]:
    engine = ctx.engine
    hf_config = engine.source.hf_config
    return {
        "model_path": ctx.settings.model,
        "tokenizer_path": ctx.settings.model,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.weight_version,
        "served_model_name": ctx.model_name,
        "model_type": getattr(hf_config, "model_type", None),
        "architectures": list(getattr(hf_config, "architectures", None) or []),
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }


@native_router.get("/model_info")
@native_router.get("/get_model_info")
async def get_model_info(ctx: Context) -> dict[str, Any]:
    return model_info(ctx)


def server_info(ctx: ServerContext) -> dict[str, Any]:
    """SGLang's top-level names where it has one, then ``server_settings`` and ``engine_config``."""
    engine = ctx.engine
    config = engine.config
    settings = {k: v for k, v in dataclasses.asdict(ctx.settings).items() if k != "api_keys"}
    settings["api_key_required"] = bool(ctx.settings.api_keys)
    return {
        "version": tokenmill.__version__,
        "model_path": ctx.settings.model,
        "tokenizer_path": ctx.settings.model,
        "served_model_name": ctx.model_name,
        "weight_version": engine.weight_version,
        "context_length": engine.max_model_len,
        "max_model_len": engine.max_model_len,
        "page_size": engine.block_size,
        "block_size": engine.block_size,
        "num_kv_blocks": engine.num_blocks,
        "max_total_num_tokens": engine.num_blocks * engine.block_size,
        "max_running_requests": config.scheduler.max_num_seqs,
        "chunked_prefill_size": config.scheduler.max_num_batched_tokens,
        "disable_radix_cache": not config.cache.enable_prefix_caching,
        "dtype": config.model.dtype,
        "kv_cache_dtype": config.cache.kv_cache_dtype,
        "device": config.model.device,
        "random_seed": config.model.seed,
        "deterministic": config.deterministic,
        "is_generation": True,
        "engine_pid": engine.engine_pid,
        "engine_alive": engine.is_alive,
        "server_settings": settings,
        "engine_config": dataclasses.asdict(config),
    }


@native_router.get("/get_load")
async def get_load(ctx: Context) -> list[dict[str, int]]:
    """SGLang's load report, one entry per data-parallel rank: requests and KV tokens in use.

    SGLang's router polls it and reads ``num_tokens`` as the worker's load.
    """
    try:
        kv = await ctx.engine.kv_stats()
    except EngineDeadError as exc:
        raise _unavailable(f"the engine is not available: {exc}") from None
    replicas = ctx.engine.replica_stats
    if replicas:  # data parallelism: each engine's latest gauges
        tokens_each = ctx.engine.num_blocks * ctx.engine.block_size // len(replicas)
        return [
            {
                "dp_rank": rank,
                "num_reqs": r.num_running + r.num_waiting,
                "num_waiting_reqs": r.num_waiting,
                "num_tokens": round(r.kv_cache_usage * tokens_each),
            }
            for rank, r in enumerate(replicas)
        ]
    return [
        {
            "dp_rank": 0,
            "num_reqs": int(kv["num_running"]) + int(kv["num_waiting"]),
            "num_waiting_reqs": int(kv["num_waiting"]),
            "num_tokens": int(kv["blocks_in_use"]) * int(kv["block_size"]),
        }
    ]


@native_router.get("/server_info")
@native_router.get("/get_server_info")
async def get_server_info(ctx: Context) -> dict[str, Any]:
    return server_info(ctx)


@native_router.get("/health_generate")
async def health_generate(ctx: Context) -> Response:
    """Generate one token through the whole server and engine; 503 (with why) when that fails."""
    ctx.check_alive()
    engine = ctx.engine
    tokenizer = engine.tokenizer
    token = tokenizer.bos_token_id
    if token is None:
        token = engine.input_processor.eos_token_ids[0] if engine.input_processor.eos_token_ids else 0
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    request_id = ctx.new_request_id("health")
    try:
        async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
            async for _ in engine.generate(request_id, [int(token)], params):
                pass
    except TimeoutError:
        raise _unavailable(f"no token within {HEALTH_GENERATE_TIMEOUT_S:.0f} s") from None
    except Exception as exc:
        raise _unavailable(f"the engine could not generate: {exc}") from None
    return Response(status_code=200)


@native_router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(ctx: Context, body: FlushCacheRequest | None = None) -> dict[str, Any]:
    """Empty the prefix cache (SGLang's ``empty_cache`` is accepted; there is no device cache to empty)."""
    try:
        flushed = await ctx.engine.reset_prefix_cache()
    except EngineDeadError as exc:
        raise _unavailable(f"the engine is not available: {exc}") from None
    if not flushed:
        raise bad_request(
            "the prefix cache was not flushed: running requests hold cached blocks; retry when they end",
            code="cache_in_use",
        )
    return {"success": True, "message": "Cache flushed."}


_BATCH_ITEM = re.compile(r"_\d+")


@native_router.post("/abort_request")
async def abort_request(body: AbortRequest, ctx: Context) -> dict[str, Any]:
    if not body.abort_all and not body.rid:
        raise bad_request("give the rid of the request to abort, or abort_all", param="rid")
    live = ctx.engine.request_ids
    if body.abort_all:
        targets = live
    else:
        targets = [
            rid
            for rid in live
            if rid == body.rid or (rid.startswith(body.rid) and _BATCH_ITEM.fullmatch(rid[len(body.rid) :]))
        ]
    for rid in targets:
        ctx.engine.abort(rid)
    return {"success": True, "num_aborted": len(targets)}


@native_router.post("/encode")
async def encode(raw: Request) -> JSONResponse:
    raise bad_request(
        "/encode returns embeddings, which embedding models compute; this server runs a generation "
        "model: use /generate",
        code="not_an_embedding_model",
    )
