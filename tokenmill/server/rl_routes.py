"""The RL routes of the native (SGLang-compatible) API: weight updates, pause, memory release.

RL frameworks (verl, slime, AReaL, OpenRLHF) drive a rollout engine over these routes and push new
weights after every training step. Each route is one engine utility call (``core/weights.py``,
``core/pause.py``) behind the server's API key; field names are SGLang's. Answers are
``{"success": true, "message": ...}`` plus the call's numbers; a bad body or a failed update is a
400 with the OpenAI-style error body, and the old weights keep serving.

Weights over HTTP travel as safetensors bytes, never pickle: ``/update_weights_from_tensor`` takes
either a raw body (``Content-Type: application/octet-stream``, the version in the
``weight_version`` query parameter) or JSON whose ``serialized_named_tensors`` is the base64 of one
safetensors blob (or a one-element list of it: SGLang sends one per tensor-parallel rank), with
``load_format`` absent or ``"safetensors"``. SGLang's own pickled formats are refused by name.
The body limit (``--max-request-body-bytes``, 16 MiB by default) applies: a whole model's tensors
go through a folder or the broadcast group, or the limit is raised.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request

from tokenmill.core.client import UtilityCallError
from tokenmill.frontend.async_llm import EngineDeadError
from tokenmill.protocol import UtilityBytes, UtilityValue
from tokenmill.server.context import ServerContext, get_context
from tokenmill.server.errors import APIError, bad_request

Context = Annotated[ServerContext, Depends(get_context)]
router = APIRouter()

# Loading weights or waiting for a trainer to join a group takes longer than a utility call usually does.
WEIGHT_CALL_TIMEOUT_S = 600.0


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UpdateFromDiskBody(_Body):
    model_path: str
    weight_version: str | None = None
    load_format: str | None = None
    flush_cache: bool = True  # the cache is always keyed by the weights: nothing stale is ever served
    abort_all_requests: bool = False
    # Accepted from SGLang clients, with nothing to do here: the update is done when the call
    # answers, it leaves a pause as it was, and there is no CUDA allocator cache or graph to redo.
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0


class UpdateFromTensorBody(_Body):
    serialized_named_tensors: str | list[str]
    weight_version: str | None = None
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class InitGroupBody(_Body):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["gloo", "nccl"] = "gloo"


class UpdateFromDistributedBody(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str | None = None
    weight_version: str | None = None
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class PauseBody(_Body):
    mode: Literal["abort", "in_place", "retract"] = "abort"


class MemoryBody(_Body):
    tags: list[Literal["kv_cache", "weights"]] | None = None


async def _call(ctx: ServerContext, method: str, args: dict[str, UtilityValue], timeout: float = 30.0) -> Any:
    """The utility call's result; a ValueError in the engine (a bad update) is a 400."""
    try:
        return await ctx.engine.call_utility(method, args, timeout=timeout)
    except EngineDeadError as exc:
        raise APIError(
            503, f"the engine is not available: {exc}", type="server_error", code="engine_unavailable"
        ) from None
    except UtilityCallError as exc:
        kind, _, message = str(exc).partition(": ")
        if kind == "ValueError":
            raise bad_request(message) from None
        raise APIError(500, str(exc), type="server_error", code="engine_error") from None
    except TimeoutError:
        raise APIError(504, f"{method} did not answer in {timeout:.0f} s", type="server_error") from None


def _update_args(
    body: UpdateFromDiskBody | UpdateFromTensorBody | UpdateFromDistributedBody,
) -> dict[str, UtilityValue]:
    return {"weight_version": body.weight_version, "abort_all_requests": body.abort_all_requests}


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: UpdateFromDiskBody, ctx: Context) -> Any:
    """Load a safetensors model folder of the same architecture in place."""
    if body.load_format not in (None, "auto", "safetensors"):
        raise bad_request(
            f"load_format {body.load_format!r}: only safetensors folders load", param="load_format"
        )
    args = {**_update_args(body), "model_path": body.model_path}
    return await _call(ctx, "update_weights_from_disk", args, WEIGHT_CALL_TIMEOUT_S)


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(raw: Request, ctx: Context) -> Any:
    """Named tensors as safetensors bytes: a raw octet-stream body, or base64 in JSON."""
    content_type = raw.headers.get("content-type", "")
    if content_type.startswith("application/octet-stream"):
        data = await raw.body()
        args: dict[str, UtilityValue] = {
            "weight_version": raw.query_params.get("weight_version"),
            "abort_all_requests": raw.query_params.get("abort_all_requests") in ("1", "true"),
        }
    else:
        try:
            body = UpdateFromTensorBody.model_validate_json(await raw.body())
        except ValueError as exc:
            raise bad_request(f"the body is not a valid update_weights_from_tensor request: {exc}") from None
        if body.load_format not in (None, "safetensors"):
            raise bad_request(
                f"load_format {body.load_format!r} is refused: weights travel as safetensors bytes, never pickle",
                param="load_format",
            )
        blobs = body.serialized_named_tensors
        if isinstance(blobs, list):
            if len(blobs) != 1:
                raise bad_request(
                    f"serialized_named_tensors has {len(blobs)} entries; this engine has one rank",
                    param="serialized_named_tensors",
                )
            blobs = blobs[0]
        try:
            data = base64.b64decode(blobs, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request(
                "serialized_named_tensors is not base64", param="serialized_named_tensors"
            ) from None
        args = _update_args(body)
    args["serialized_named_tensors"] = UtilityBytes(data)
    return await _call(ctx, "update_weights_from_tensor", args, WEIGHT_CALL_TIMEOUT_S)


@router.post("/init_weights_update_group")
async def init_weights_update_group(body: InitGroupBody, ctx: Context) -> Any:
    """Join the trainer's broadcast group (rank 0 is the trainer); returns once every rank joined."""
    return await _call(ctx, "init_weights_update_group", body.model_dump(), WEIGHT_CALL_TIMEOUT_S)


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(ctx: Context, body: dict[str, str] | None = None) -> Any:
    args: dict[str, UtilityValue] = {"group_name": (body or {}).get("group_name")}
    return await _call(ctx, "destroy_weights_update_group", args)


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(body: UpdateFromDistributedBody, ctx: Context) -> Any:
    """Receive these tensors from rank 0's broadcasts, in order, and load them."""
    args = {
        **_update_args(body),
        "names": list(body.names),
        "dtypes": list(body.dtypes),
        "shapes": [list(shape) for shape in body.shapes],
        "group_name": body.group_name,
    }
    return await _call(ctx, "update_weights_from_distributed", args, WEIGHT_CALL_TIMEOUT_S)  # type: ignore[arg-type]


@router.get("/get_weight_version")
async def get_weight_version(ctx: Context) -> Any:
    return await _call(ctx, "get_weight_version", {})


@router.post("/pause_generation")
async def pause_generation(ctx: Context, body: PauseBody | None = None) -> Any:
    return await _call(ctx, "pause_generation", {"mode": (body or PauseBody()).mode})


@router.post("/continue_generation")
async def continue_generation(ctx: Context) -> Any:
    return await _call(ctx, "continue_generation", {})


@router.post("/release_memory_occupation")
async def release_memory_occupation(ctx: Context, body: MemoryBody | None = None) -> Any:
    tags = (body or MemoryBody()).tags
    return await _call(ctx, "release_memory_occupation", {"tags": list(tags) if tags else None})


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(ctx: Context, body: MemoryBody | None = None) -> Any:
    tags = (body or MemoryBody()).tags
    return await _call(ctx, "resume_memory_occupation", {"tags": list(tags) if tags else None})
