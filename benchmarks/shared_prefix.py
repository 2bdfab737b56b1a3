"""Shared-prefix serving: tokenmill with the radix prefix cache on and off, and llama-server.

The workload of the RadixAttention issue: G groups x R requests, each group sharing a long prefix
(default 8 x 16, 1,024-token prefix + 64-token question, 64 output tokens), 16 concurrent clients.
Prints mean / p99 TTFT and output throughput for each, and the ratios (cache on vs off, and vs
llama-server, whose per-slot prompt cache stays on here).

    LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin .venv/bin/python benchmarks/shared_prefix.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from peers import (
    bundled_gguf,
    cpu_name,
    git_describe,
    llama_cpp_tool,
    llama_server,
    print_table,
    requantized,
    run_bench,
    summary,
)
from peers import tokenmill_server as tokenmill

from tokenmill.worker.model_runner import resolve_dtype


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--llama-server", default=None, help="path of llama-server (else $LLAMA_CPP_BIN)")
    parser.add_argument("--llama-quantize", default=None, help="path of llama-quantize (else $LLAMA_CPP_BIN)")
    parser.add_argument(
        "--llama-weights",
        default="BF16",
        help="llama-server's weight format, made from the bundled Q4_1 file with llama-quantize (BF16 prefills "
        "fastest on AVX512-BF16 CPUs, F16 on AVX2-only ones; check with llama-bench -p 1024); Q4_1 keeps the original",
    )
    parser.add_argument("--policy", default="lpm", choices=["fcfs", "lpm"], help="tokenmill's waiting policy")
    parser.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="tokenmill's KV cache type; by default 16 bits as llama-server's (its -ctk/-ctv f16): the model's "
        "own dtype where --dtype auto is bfloat16 (CPUs that compute it), float16 where it is float32",
    )
    args = parser.parse_args()
    model_dtype = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")  # what serve picks
    if args.kv_cache_dtype is None:
        args.kv_cache_dtype = "float16" if model_dtype == "float32" else "auto"
    kv_shown = f"auto ({model_dtype}, the model's)" if args.kv_cache_dtype == "auto" else args.kv_cache_dtype

    bench_args = [
        "--dataset", "shared-prefix",
        "--prefix-groups", str(args.groups),
        "--prompts-per-group", str(args.per_group),
        "--prefix-len", str(args.prefix_len),
        "--question-len", str(args.question_len),
        "--output-len", str(args.output_len),
        "--max-concurrency", str(args.concurrency),
        "--ignore-eos",
    ]  # fmt: skip
    print(
        f"shared prefix: {args.groups} groups x {args.per_group}, {args.prefix_len} + {args.question_len} "
        f"tokens in, {args.output_len} out, {args.concurrency} concurrent; {cpu_name()}; tokenmill {git_describe()}, "
        f"KV cache {kv_shown}"
    )
    context = ["--max-model-len", "2048", "--kv-cache-dtype", args.kv_cache_dtype]
    rows: dict[str, dict[str, float]] = {}
    with tokenmill("smollm2-135m", [*context, "--policy", args.policy]) as url:
        rows["tokenmill cache on"] = summary(run_bench(url, "cache-on", bench_args))
    with tokenmill("smollm2-135m", [*context, "--no-prefix-cache"]) as url:
        rows["tokenmill cache off"] = summary(run_bench(url, "cache-off", bench_args))

    server_bin = llama_cpp_tool("llama-server", args.llama_server)
    peer_name = None
    if server_bin is not None:
        # The peer runs on the format that prefills fastest on the machine; its prompt cache stays on.
        gguf, peer_name = bundled_gguf(), "llama-server Q4_1"
        quantize_bin = llama_cpp_tool("llama-quantize", args.llama_quantize)
        if args.llama_weights != "Q4_1" and quantize_bin is not None:
            cache_dir = Path.home() / ".cache/tokenmill-bench"
            gguf = requantized(gguf, quantize_bin, args.llama_weights, cache_dir)
            peer_name = f"llama-server {args.llama_weights}"
        with llama_server(server_bin, gguf, args.concurrency, 2048, []) as url:
            rows[peer_name] = summary(run_bench(url, "llama-server", bench_args))
    else:
        print("llama-server not found: pass --llama-server or set LLAMA_CPP_BIN (see PEERS.md)")
    print_table(rows, baseline="tokenmill cache off")
    if peer_name is not None:
        on, peer = rows["tokenmill cache on"], rows[peer_name]
        print(f"cache on vs {peer_name}: throughput x{on['output_tok_s'] / peer['output_tok_s']:.2f}")


if __name__ == "__main__":
    main()
