"""Command line: ``tokenmill serve | generate | chat | bench``."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by every command that runs a model."""
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max-model-len", type=int, default=None, help="context window (prompt + output)")
    parser.add_argument(
        "--kv-cache-memory", type=float, default=0.25, help="KV bytes, or a fraction (<= 1) of free memory"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="per-step token budget")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--no-prefix-cache", action="store_true", help="disable the radix prefix cache")
    parser.add_argument("--policy", default="fcfs", choices=["fcfs", "lpm"], help="waiting-queue order")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    memory: int | float = args.kv_cache_memory
    if memory > 1:
        memory = int(memory)
    return {
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "kv_cache_memory": memory,
        "block_size": args.block_size,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "enable_prefix_caching": not args.no_prefix_cache,
        "policy": args.policy,
        "num_threads": args.num_threads,
        "seed": args.seed,
    }


def _sampling_params(args: argparse.Namespace) -> Any:
    from tokenmill.sampling_params import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
    )


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--sampling-seed", type=int, default=None)


def cmd_generate(args: argparse.Namespace) -> int:
    from tokenmill.llm import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    outputs = llm.generate(args.prompt, _sampling_params(args), use_tqdm=False)
    for output in outputs:
        print(output.outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive chat; the reply streams to the terminal token by token."""
    from tokenmill.chat_session import ChatSession

    session = ChatSession(args.model, _sampling_params(args), system=args.system, **engine_kwargs(args))
    print(f"tokenmill chat with {args.model}. Empty line or Ctrl-D to quit.")
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if not line.strip():
            return 0
        for piece in session.send(line):
            print(piece, end="", flush=True)
        print()


def cmd_serve(args: argparse.Namespace) -> int:
    from tokenmill.server.cli_args import run_server

    run_server(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference and serving engine")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    generate = sub.add_parser("generate", help="complete prompts offline and print the text")
    generate.add_argument("--model", default="smollm2-135m")
    generate.add_argument("--prompt", action="append", required=True, help="may be given several times")
    add_engine_args(generate)
    _add_sampling_args(generate)
    generate.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal, streamed")
    chat.add_argument("--model", default="smollm2-135m")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    from tokenmill.server.cli_args import add_serve_args

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)

    from tokenmill.bench.cli import add_bench_args

    bench = sub.add_parser("bench", help="benchmark clients")
    add_bench_args(bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
