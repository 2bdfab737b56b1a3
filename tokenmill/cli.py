"""Command line: ``tokenmill serve | generate | chat | bench | router``."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from tokenmill.engine_args import add_engine_args, engine_kwargs


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


def cmd_router(args: argparse.Namespace) -> int:
    from tokenmill.router.cli import run_router

    return run_router(args)


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

    from tokenmill.router.cli import add_router_args

    router = sub.add_parser("router", help="HTTP router in front of several `tokenmill serve` workers")
    add_router_args(router)
    router.set_defaults(func=cmd_router)

    from tokenmill.train.eagle import add_train_eagle_args, run_train_eagle

    train_eagle = sub.add_parser("train-eagle", help="train an EAGLE draft head for a model on this CPU")
    add_train_eagle_args(train_eagle)
    train_eagle.set_defaults(func=run_train_eagle)
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
