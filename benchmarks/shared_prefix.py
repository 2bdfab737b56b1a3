"""Shared-prefix serving: tokenmill with the radix prefix cache on and off, and llama-server.

The workload of the RadixAttention issue: G groups x R requests, each group sharing a long prefix
(default 8 x 16, 1,024-token prefix + 64-token question, 64 output tokens), 16 concurrent clients.
Prints mean / p99 TTFT and output throughput for each, and the ratios (cache on vs off, and vs
llama-server, whose per-slot prompt cache stays on here).

    LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin .venv/bin/python benchmarks/shared_prefix.py

``--repeats N`` runs the two tokenmill servers N times each, alternating, and prints each pair's ratio
and the means (the cache-on mean moves with a VM's speed more than cache off does).
"""

from __future__ import annotations

import argparse

import torch
from peers import (
    add_llama_peer_arguments,
    cpu_name,
    git_describe,
    llama_peer,
    llama_server,
    mean_summary,
    print_table,
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
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run tokenmill with the cache on and off this many times each, alternating: a VM's speed drifts "
        "over minutes, so one pair can tilt the ratio; the table shows the means over the runs",
    )
    add_llama_peer_arguments(parser)
    parser.add_argument("--policy", default="lpm", choices=["fcfs", "lpm"], help="tokenmill's waiting policy")
    parser.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="tokenmill's KV cache type; by default 16 bits as llama-server's (its -ctk/-ctv f16): the model's "
        "own dtype where --dtype auto is bfloat16 (CPUs that compute it), float16 where it is float32",
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
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
    on_runs, off_runs = [], []
    for run in range(1, args.repeats + 1):
        with tokenmill("smollm2-135m", [*context, "--policy", args.policy]) as url:
            on_runs.append(summary(run_bench(url, "cache-on", bench_args)))
        with tokenmill("smollm2-135m", [*context, "--no-prefix-cache"]) as url:
            off_runs.append(summary(run_bench(url, "cache-off", bench_args)))
        if args.repeats > 1:
            on, off = on_runs[-1], off_runs[-1]
            print(
                f"run {run}: mean TTFT cache on {on['ttft_mean_ms']:.1f} ms, off {off['ttft_mean_ms']:.1f} ms "
                f"(x{off['ttft_mean_ms'] / on['ttft_mean_ms']:.2f}); {on['output_tok_s']:.1f} / "
                f"{off['output_tok_s']:.1f} tok/s",
                flush=True,
            )
    rows["tokenmill cache on"] = mean_summary(on_runs)
    rows["tokenmill cache off"] = mean_summary(off_runs)

    peer = llama_peer(args)
    peer_name = None
    if peer is not None:
        # The peer runs on the format that prefills fastest on the machine; its prompt cache stays on.
        server_bin, gguf, peer_name = peer
        with llama_server(server_bin, gguf, args.concurrency, 2048, []) as url:
            rows[peer_name] = summary(run_bench(url, "llama-server", bench_args))
    print_table(rows, baseline="tokenmill cache off")
    if peer_name is not None:
        on, peer = rows["tokenmill cache on"], rows[peer_name]
        print(f"cache on vs {peer_name}: throughput x{on['output_tok_s'] / peer['output_tok_s']:.2f}")


if __name__ == "__main__":
    main()
