"""``tokenmill router`` arguments and the entry point that runs the router (``router/app.py``)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import socket
import sys
from typing import TYPE_CHECKING

from tokenmill.config import DP_POLICIES
from tokenmill.router.policy import DEFAULT_BALANCE_ABS, DEFAULT_BALANCE_REL

if TYPE_CHECKING:
    from tokenmill.router.app import RouterSettings


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--worker-urls",
        nargs="*",
        default=[],
        metavar="URL",
        help="the workers' base URLs (http://host:port of `tokenmill serve` processes); more can be added "
        "at run time with POST /workers",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)"
    )
    parser.add_argument("--port", type=int, default=30000, help="port to listen on (0 picks a free one)")
    parser.add_argument(
        "--policy",
        default="cache_aware",
        choices=DP_POLICIES,
        help="which worker serves a request: the one that was sent the longest prefix of its text "
        "(cache_aware), the next in turn (round_robin) or the one with the fewest requests (least_load)",
    )
    parser.add_argument(
        "--balance-abs",
        type=int,
        default=DEFAULT_BALANCE_ABS,
        help="cache_aware: go to the least loaded worker instead when the loads differ by more than this "
        "many requests (and by --balance-rel)",
    )
    parser.add_argument(
        "--balance-rel",
        type=float,
        default=DEFAULT_BALANCE_REL,
        help="cache_aware: ... and the busiest worker has more than this many times the idlest's requests",
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health (repeat for several keys)",
    )
    parser.add_argument(
        "--worker-api-key",
        default=None,
        help="the key to send to workers (default: pass the client's Authorization header on)",
    )
    parser.add_argument("--health-interval", type=float, default=5.0, help="seconds between health checks")
    parser.add_argument(
        "--health-failure-threshold",
        type=int,
        default=2,
        help="failed health checks in a row that take a worker out of dispatch",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds a worker may take to answer or stream"
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    # Imported here: `tokenmill --help` should not pay for FastAPI.
    from tokenmill.router.app import RouterSettings
    from tokenmill.router.workers import normalize_url

    return RouterSettings(
        worker_urls=[normalize_url(url) for url in args.worker_urls],
        policy=args.policy,
        balance_abs=args.balance_abs,
        balance_rel=args.balance_rel,
        api_keys=list(args.api_key or []),
        worker_api_key=args.worker_api_key,
        health_interval=args.health_interval,
        health_failure_threshold=args.health_failure_threshold,
        request_timeout=args.request_timeout,
    )


def run_router(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; exits with a message on bad arguments."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.health_interval <= 0 or args.health_failure_threshold < 1:
        sys.exit("tokenmill router: --health-interval must be > 0 and --health-failure-threshold >= 1")
    from tokenmill.router.app import build_router_app

    try:
        settings = settings_from_args(args)
        app = build_router_app(settings)
    except ValueError as exc:
        sys.exit(f"tokenmill router: {exc}")
    import uvicorn

    class RouterServer(uvicorn.Server):
        """uvicorn's server, announcing the URL once the socket is bound."""

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                print(f"tokenmill router at http://{host}:{port}", flush=True)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="on")
    with contextlib.suppress(KeyboardInterrupt):
        RouterServer(config).run()
    return 0
