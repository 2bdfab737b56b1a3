"""Data parallelism: ``cache_aware`` vs ``round_robin`` dispatch over two engine processes.

One ``tokenmill serve --data-parallel-size 2`` per policy, side by side in one run, on the workload
of the scaling issue: G system prompts x U users (default 8 x 16, shuffled), each request a shared
system prompt plus its own question, through ``tokenmill bench serve --dataset shared-prefix``.
Prints each policy's prefix-cache hit rate (the engines' own counters, summed over both replicas:
``tokenmill:prefix_cache_hits`` / ``prefix_cache_queries``), output throughput and TTFT, and the
ratios cache_aware / round_robin.

The KV cache of each replica is sized (``--num-blocks``) to hold about half the system prompts, as
a cache under pressure is: ``cache_aware`` keeps each prompt on one replica, so each cache holds
its half; ``round_robin`` sends every prompt to both, and each cache thrashes over all of them.

    flock /tmp/tokenmill-bench.lock .venv/bin/python benchmarks/dp_router.py [--backend ray]

``--backend ray`` runs the replicas as Ray actors (``--data-parallel-backend ray``) on a local Ray
cluster each server starts. Either way the frontend's prefix index is fed by the replicas' own KV
cache events (``core/kv/kv_events.py``).
"""

from __future__ import annotations

import argparse
import re

import httpx
from peers import cpu_name, git_describe, print_table, run_bench, summary
from peers import tokenmill_server as tokenmill


def cache_counters(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=30).text

    def value(name: str) -> float:
        match = re.search(rf"^tokenmill:{name}_total\{{[^}}]*\}} (\S+)$", text, re.M)
        assert match is not None, name
        return float(match.group(1))

    return value("prefix_cache_hits"), value("prefix_cache_queries")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--backend",
        choices=("mp", "ray"),
        default="mp",
        help="what runs the replicas (--data-parallel-backend): engine processes, or Ray actors on a "
        "local Ray cluster the server starts",
    )
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV blocks (of 16 tokens) per replica; default: room for about 4.5 of the system prompts "
        "plus the running requests' own blocks",
    )
    args = parser.parse_args()
    blocks_per_prefix = -(-args.prefix_len // 16)
    own_blocks = -(-(args.question_len + args.output_len) // 16) + 1
    num_blocks = args.num_blocks or int(4.5 * blocks_per_prefix) + args.concurrency * own_blocks
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
        f"data parallel 2, shared prefix: {args.groups} system prompts x {args.per_group} users, "
        f"{args.prefix_len} + {args.question_len} tokens in, {args.output_len} out, {args.concurrency} "
        f"concurrent, {num_blocks} KV blocks per replica, {args.backend} replicas; {cpu_name()}; "
        f"tokenmill {git_describe()}",
        flush=True,
    )
    rows: dict[str, dict[str, float]] = {}
    for policy in ("cache_aware", "round_robin"):
        server_args = [
            "--data-parallel-size", "2", "--dp-policy", policy, "--max-model-len", "2048",
            "--num-blocks", str(num_blocks), "--data-parallel-backend", args.backend,
        ]  # fmt: skip
        with tokenmill("smollm2-135m", server_args) as url:
            row = summary(run_bench(url, policy, bench_args))
            hits, queries = cache_counters(url)
        row["cache_hit_rate"] = hits / queries if queries else 0.0
        rows[policy] = row
        print(f"{policy}: hit rate {row['cache_hit_rate']:.3f}, {row['output_tok_s']:.1f} tok/s", flush=True)
    print_table(rows, baseline="round_robin")
    aware, turns = rows["cache_aware"], rows["round_robin"]
    print(
        f"cache_aware / round_robin: cache hit rate x{aware['cache_hit_rate'] / max(turns['cache_hit_rate'], 1e-9):.2f}, "
        f"output throughput x{aware['output_tok_s'] / turns['output_tok_s']:.2f}, "
        f"mean TTFT x{turns['ttft_mean_ms'] / max(aware['ttft_mean_ms'], 1e-9):.2f} (lower is better: round_robin's / cache_aware's)"
    )


if __name__ == "__main__":
    main()
