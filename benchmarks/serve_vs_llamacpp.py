"""Serving throughput: `tokenmill serve` vs llama.cpp's `llama-server`, same GGUF, same prompts.

ShareGPT first turns, 16 concurrent clients, 128-token outputs (EOS ignored so both produce the
same lengths). Prints output tokens/s and TTFT p50/p99 for each server and the ratios.

    LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin .venv/bin/python benchmarks/serve_vs_llamacpp.py

llama-server runs twice, on the original Q4_1 file and on a BF16 copy (made once with
llama-quantize, cached in ~/.cache/tokenmill-bench), both with --no-cache-prompt (see PEERS.md:
its prompt cache crashed under this load). Without llama.cpp tools only tokenmill is measured.
"""

from __future__ import annotations

import argparse
from pathlib import Path

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
    tokenmill_server,
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--llama-server", default=None, help="path of llama-server (else $LLAMA_CPP_BIN)")
    parser.add_argument("--llama-quantize", default=None, help="path of llama-quantize (else $LLAMA_CPP_BIN)")
    parser.add_argument("--tokenmill-args", default="", help="extra `tokenmill serve` arguments")
    args = parser.parse_args()

    gguf = bundled_gguf()
    bench_args = [
        "--dataset", "sharegpt",
        "--num-prompts", str(args.num_prompts),
        "--max-concurrency", str(args.concurrency),
        "--output-len", str(args.output_len),
        "--ignore-eos",
        "--endpoint", "completions",
        "--num-warmups", "2",
    ]  # fmt: skip
    print(
        f"ShareGPT x{args.num_prompts}, {args.concurrency} concurrent, {args.output_len} out; {cpu_name()}; tokenmill {git_describe()}"
    )
    rows: dict[str, dict[str, float]] = {}
    with tokenmill_server("smollm2-135m", args.tokenmill_args.split()) as url:
        rows["tokenmill (bf16)"] = summary(run_bench(url, "tokenmill", bench_args))

    server_bin = llama_cpp_tool("llama-server", args.llama_server)
    if server_bin is None:
        print("llama-server not found: pass --llama-server or set LLAMA_CPP_BIN (see PEERS.md)")
        print_table(rows)
        return
    files = {"llama-server Q4_1": gguf}
    quantize_bin = llama_cpp_tool("llama-quantize", args.llama_quantize)
    if quantize_bin is not None:
        files["llama-server BF16"] = requantized(
            gguf, quantize_bin, "BF16", Path.home() / ".cache/tokenmill-bench"
        )
    for name, path in files.items():
        with llama_server(server_bin, path, args.concurrency, 2048, ["--no-cache-prompt"]) as url:
            rows[name] = summary(run_bench(url, name, bench_args))

    best = max((n for n in rows if n.startswith("llama")), key=lambda n: rows[n]["output_tok_s"])
    print_table(rows, baseline=best)


if __name__ == "__main__":
    main()
