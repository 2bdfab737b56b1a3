"""LoRA adapters over HTTP: load and unload at run time, list them as models, export their metrics.

``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` reads and checks a PEFT adapter folder in
the engine (400 with the reason when it does not fit the model) and serves it under that name: a
chat or completion request whose ``model`` is the name runs with it. ``POST
/v1/unload_lora_adapter {"lora_name"}`` stops serving it: requests still waiting for it fail with an
error saying so, running ones finish with it (never mixed with other weights), and later requests
naming it get 404. Both sit behind the API key like every ``/v1`` route. ``GET /v1/models`` lists
each adapter with ``parent`` = the base model and ``root`` = its folder. ``GET /metrics`` refreshes
the LoRA gauges from the engine first (``refresh_lora_metrics``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from pydantic import BaseModel

from tokenmill.core.client import UtilityCallError
from tokenmill.frontend.async_llm import EngineDeadError
from tokenmill.server.context import ServerContext, get_context
from tokenmill.server.errors import APIError, bad_request, model_not_found
from tokenmill.server.openai_protocol import ModelCard

Context = Annotated[ServerContext, Depends(get_context)]
lora_router = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str


def lora_model_cards(ctx: ServerContext) -> list[ModelCard]:
    """One model card per served adapter, its ``parent`` the base model."""
    return [
        ModelCard(id=name, max_model_len=ctx.engine.max_model_len, root=path, parent=ctx.model_name)
        for name, path in sorted(ctx.lora_adapters.items())
    ]


def _check_enabled(ctx: ServerContext) -> None:
    if not ctx.engine.config.lora.enable_lora:
        raise bad_request(
            "LoRA is not enabled on this server (start it with --enable-lora)", code="lora_disabled"
        )


async def _call(ctx: ServerContext, method: str, args: dict[str, Any], param: str) -> dict[str, Any]:
    try:
        return await ctx.engine.call_utility(method, args)
    except UtilityCallError as exc:
        raise bad_request(str(exc), param=param) from None
    except EngineDeadError as exc:
        raise APIError(
            503, f"the engine is not available: {exc}", type="server_error", code="engine_unavailable"
        ) from None


@lora_router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, ctx: Context) -> dict[str, Any]:
    _check_enabled(ctx)
    if body.lora_name in ctx.settings.served_model_names:
        raise bad_request(f"{body.lora_name!r} is the base model's name", param="lora_name")
    result = await _call(
        ctx, "load_lora", {"lora_name": body.lora_name, "lora_path": body.lora_path}, "lora_path"
    )
    ctx.lora_adapters[body.lora_name] = body.lora_path
    return {"object": "lora_adapter", **result}


@lora_router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, ctx: Context) -> dict[str, Any]:
    _check_enabled(ctx)
    if body.lora_name not in ctx.lora_adapters:
        raise model_not_found(body.lora_name)
    del ctx.lora_adapters[body.lora_name]  # new requests naming it are refused from now on
    result = await _call(ctx, "unload_lora", {"lora_name": body.lora_name}, "lora_name")
    return {"object": "lora_adapter", **result}


class _LoRACollector:
    """The engine's LoRA numbers as of the last ``refresh_lora_metrics``."""

    def __init__(self, model_name: str) -> None:
        self.labels = [model_name]
        self.values: dict[str, float] = {}

    def collect(self) -> Iterator[Metric]:
        gauges = {
            "lora_loaded_adapters": "LoRA adapters loaded.",
            "lora_running_adapters": "Distinct LoRA adapters of running requests.",
            "lora_waiting_adapters": "Distinct LoRA adapters only waiting requests use.",
        }
        counters = {
            "lora_slot_swaps": "Adapters put into a device slot they were not in.",
            "lora_load_seconds": "Seconds spent reading adapters and filling device slots.",
            "lora_loads": "Adapters loaded (read and checked).",
        }
        for name, doc in gauges.items():
            metric = GaugeMetricFamily(f"tokenmill:{name}", doc, labels=["model_name"])
            metric.add_metric(self.labels, self.values.get(name, 0.0))
            yield metric
        for name, doc in counters.items():
            counter = CounterMetricFamily(f"tokenmill:{name}", doc, labels=["model_name"])
            key = "lora_load_seconds_total" if name == "lora_load_seconds" else name
            counter.add_metric(self.labels, self.values.get(key, 0.0))
            yield counter


async def refresh_lora_metrics(ctx: ServerContext) -> None:
    """Read the engine's LoRA numbers for the next ``/metrics`` render (LoRA servers only)."""
    if not ctx.engine.config.lora.enable_lora or not ctx.engine.is_alive:
        return
    collector = ctx.lora_metrics
    if collector is None:
        collector = ctx.lora_metrics = _LoRACollector(ctx.model_name)
        ctx.metrics.registry.register(collector)  # type: ignore[arg-type]
    stats = await ctx.engine.kv_stats()
    collector.values = {k: float(v) for k, v in stats.items() if k.startswith("lora_")}
