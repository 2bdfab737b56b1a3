"""``tokenmill serve`` arguments and the entry point that runs the server.

``add_serve_args`` fills an argparse parser (``tokenmill.cli`` owns the sub-command); ``run_server``
builds the engine config and server settings from the parsed arguments, starts uvicorn and returns
once the server has shut down (the engine process is stopped by then).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import socket
import sys
from typing import TYPE_CHECKING

import uvicorn

from tokenmill.config import DATA_PARALLEL_BACKENDS, DP_POLICIES, EngineConfig, build_engine_config
from tokenmill.core.client import spawn_engines, stop_engines
from tokenmill.engine_args import add_engine_args, engine_kwargs
from tokenmill.frontend.reasoning_parsers import REASONING_PARSERS
from tokenmill.frontend.tool_parsers import TOOL_PARSERS
from tokenmill.server.http_protocol import header_deadline_protocol
from tokenmill.server.settings import DEFAULT_MAX_BODY_BYTES, ServerSettings

if TYPE_CHECKING:
    from fastapi import FastAPI

    from tokenmill.frontend.async_llm import AsyncLLM

DEFAULT_MODEL = "smollm2-135m"


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Add every ``tokenmill serve`` option to ``parser``."""
    parser.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        help=f"bundled alias, model folder or .gguf file (default {DEFAULT_MODEL})",
    )
    server = parser.add_argument_group("server")
    server.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)"
    )
    server.add_argument("--port", type=int, default=8000, help="port to listen on (0 picks a free one)")
    server.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health (repeat for several keys; "
        "each key is also a user for fair scheduling when a request gives no 'user')",
    )
    server.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use for the model (default: MODEL)",
    )
    server.add_argument(
        "--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger bodies get 413"
    )
    server.add_argument(
        "--log-requests", action="store_true", help="also log prompt and completion text (off: never logged)"
    )
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    server.add_argument("--access-log", action="store_true", help="log every HTTP request line (uvicorn)")
    server.add_argument(
        "--engine-start-timeout", type=float, default=600.0, help="seconds to wait for the model"
    )
    server.add_argument(
        "--shutdown-timeout", type=float, default=5.0, help="seconds in-flight requests get on SIGINT/SIGTERM"
    )
    server.add_argument(
        "--no-webui",
        dest="webui",
        action="store_false",
        help="do not serve the chat page at / and the dashboard at /dashboard (/metrics.json stays)",
    )
    server.add_argument(
        "--unknown-fields",
        default="reject",
        choices=["reject", "warn"],
        help="unknown fields in chat/completions requests: 'reject' answers 400 naming the field; 'warn' "
        "logs their names, ignores them and lists them in the X-Ignored-Fields response header",
    )
    server.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection has to send a request's headers (when opened and after each answer)",
    )
    server.add_argument(
        "--body-timeout",
        type=float,
        default=60.0,
        help="seconds a request's body may take to arrive (408 after)",
    )
    server.add_argument(
        "--engine-death-exit-delay",
        type=float,
        default=5.0,
        help="if the engine process dies: seconds the server answers 503 before it exits with status 1",
    )
    chat = parser.add_argument_group("tool calls and reasoning")
    chat.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="format of the model's tool calls for tool_choice 'auto' (default: detected from the chat template)",
    )
    chat.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="split <think>...</think> (qwen3, deepseek_r1) or harmony analysis channels (openai_gptoss) into "
        "reasoning_content (default: reasoning stays in the content)",
    )
    add_engine_args(parser)
    add_data_parallel_args(parser)


def add_data_parallel_args(parser: argparse.ArgumentParser) -> None:
    """Data parallelism: several engine processes behind this server (``core/dp_client.py``)."""
    dp = parser.add_argument_group("data parallelism")
    dp.add_argument(
        "--data-parallel-size",
        "--dp-size",
        type=int,
        default=1,
        help="engine processes (replicas, each with the whole model and its own KV cache) behind this server; "
        "on a CPU each gets an equal share of the cores unless --num-threads says otherwise",
    )
    dp.add_argument(
        "--dp-policy",
        default="cache_aware",
        choices=DP_POLICIES,
        help="which replica serves a request: the one believed to cache the longest prefix of its prompt "
        "(cache_aware), the next in turn (round_robin) or the one with the fewest requests (least_load)",
    )
    dp.add_argument(
        "--dp-balance-abs",
        type=int,
        default=8,
        help="cache_aware: go to the least loaded replica instead when the loads differ by more than this "
        "many requests (and by --dp-balance-rel)",
    )
    dp.add_argument(
        "--data-parallel-backend",
        default="mp",
        choices=DATA_PARALLEL_BACKENDS,
        help="what runs the replicas: engine processes on this machine (mp) or Ray actors, each in its "
        "own placement group, on the Ray cluster this server joins (ray; pip install 'tokenmill[ray]')",
    )
    dp.add_argument(
        "--dp-balance-rel",
        type=float,
        default=1.5,
        help="cache_aware: ... and the busiest replica has more than this many times the idlest's requests",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = args.served_model_name or [args.model]
    return build_engine_config(
        args.model,
        served_model_name=names[0],
        data_parallel_size=args.data_parallel_size,
        dp_policy=args.dp_policy,
        dp_balance_abs=args.dp_balance_abs,
        dp_balance_rel=args.dp_balance_rel,
        data_parallel_backend=args.data_parallel_backend,
        **engine_kwargs(args),
    )


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings(
        model=args.model,
        served_model_names=list(args.served_model_name or []),
        host=args.host,
        port=args.port,
        api_keys=list(args.api_key or []),
        max_request_body_bytes=args.max_request_body_bytes,
        log_requests=args.log_requests,
        log_level=args.log_level.lower(),  # `tokenmill --log-level INFO serve` spells it in capitals
        access_log=args.access_log,
        engine_start_timeout=args.engine_start_timeout,
        shutdown_timeout=args.shutdown_timeout,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        engine_death_exit_delay=args.engine_death_exit_delay,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        webui=args.webui,
        unknown_fields=args.unknown_fields,
    )


class _Server(uvicorn.Server):
    """uvicorn's server, announcing the URL once the socket is bound and the engine is ready, and
    shutting down (``engine_death`` then says why) a while after the engine process dies."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, settings: ServerSettings) -> None:
        super().__init__(config)
        self.app = app
        self.settings = settings
        self.engine_death: str | None = None
        self._watcher: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self._watcher = asyncio.create_task(self._exit_when_engine_dies(self.app.state.ctx.engine))
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(f"tokenmill serving {self.settings.model_name} at http://{host}:{port}/v1", flush=True)

    async def _exit_when_engine_dies(self, engine: AsyncLLM) -> None:
        """Requests in flight have their 503s by the time ``engine_died`` is set; new ones get 503
        (and /health too) for ``engine_death_exit_delay`` seconds, so load balancers see the server
        go unhealthy; then the server shuts down and the process exits with status 1, for its
        supervisor to restart it."""
        await engine.engine_died.wait()
        delay = self.settings.engine_death_exit_delay
        self.engine_death = engine.dead_reason or "the engine process is not running"
        logging.getLogger(__name__).error(
            "the engine process died (%s); answering 503 for %g s, then exiting", self.engine_death, delay
        )
        await asyncio.sleep(delay)
        self.should_exit = True


def run_server(args: argparse.Namespace) -> None:
    """Serve until SIGINT/SIGTERM; exits the process with an error message on bad arguments."""
    settings = settings_from_args(args)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = engine_config_from_args(args)
        config.validate()
    except ValueError as exc:
        sys.exit(f"tokenmill serve: {exc}")
    # The engine process starts loading now, while this process imports the server (FastAPI,
    # transformers, torch: seconds), resolves the model and starts uvicorn: the app attaches to it.
    engines = spawn_engines(config, settings.log_level.upper())  # data_parallel_size of them
    from tokenmill.loader import resolve_model
    from tokenmill.server.app import build_app

    try:
        source = resolve_model(args.model)
    except ValueError as exc:
        stop_engines(engines)
        sys.exit(f"tokenmill serve: {exc}")
    app = build_app(settings, config, source, spawned=engines)
    uvicorn_config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.access_log,
        timeout_graceful_shutdown=math.ceil(settings.shutdown_timeout),
        lifespan="on",
        http=header_deadline_protocol(settings.header_timeout),
    )
    server = _Server(uvicorn_config, app, settings)
    # uvicorn re-raises the SIGINT it handled once shutdown is done; that is not an error.
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if server.engine_death is not None:
        sys.exit(f"tokenmill serve: exiting because the engine process died: {server.engine_death}")
