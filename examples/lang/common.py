"""Shared by the examples: pick the backend from the command line.

Default: the bundled SmolLM2 in this process. ``--url http://host:port`` runs on a tokenmill (or
SGLang) server through ``/generate``; ``--openai http://host:port/v1`` on any OpenAI-compatible one.
"""

from __future__ import annotations

import argparse
import time

from tokenmill.lang import Backend, Endpoint, OpenAIEndpoint, Runtime


def backend_from_args(description: str) -> tuple[Backend, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="smollm2-135m", help="model for the in-process runtime")
    parser.add_argument("--url", help="a tokenmill server (native /generate API)")
    parser.add_argument("--openai", help="an OpenAI-compatible server's /v1 URL")
    parser.add_argument("--tokenizer", help="tokenizer for remote servers (default: the served model)")
    parser.add_argument("--trace", help="write the call timeline (HTML) to this file")
    args = parser.parse_args()
    started = time.perf_counter()
    backend: Backend
    if args.url:
        backend = Endpoint(args.url, tokenizer=args.tokenizer)
    elif args.openai:
        backend = OpenAIEndpoint(args.openai, tokenizer=args.tokenizer)
    else:
        backend = Runtime(args.model, dtype="float32", max_model_len=2048)
        print(f"[loaded {args.model} in {time.perf_counter() - started:.1f} s]")
    return backend, args
