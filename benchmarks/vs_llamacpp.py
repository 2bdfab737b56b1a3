"""tokenmill vs llama.cpp on the CPU workloads of issue 5, side by side in one run.

Workloads (SmolLM2-135M, or ``--model gemma3-270m``: Gemma 3 270M; 128-token prompts and outputs,
EOS ignored):

- single-stream decode: one sequence; tokenmill's decode rate vs ``llama-bench -p 0 -n 128``
- 64-sequence decode: tokenmill's decode rate with 64 sequences vs ``llama-batched-bench`` S_TG at
  npl 64
- prefill: prompt tokens/s (64 prompts) vs the best of ``llama-bench -p 128`` and batched-bench S_PP
- server, 16 concurrent: ``tokenmill bench serve`` (ShareGPT) against ``tokenmill serve`` and
  ``llama-server``

``--isa avx2,avx512_bf16`` prints a table per ``TOKENMILL_CPU_ISA`` path (tokenmill held to that
instruction set; llama.cpp from a build held to the same instructions where one is given:
``$LLAMA_CPP_BIN_AVX2`` for ``avx2``, an AVX2-only build, ``$LLAMA_CPP_BIN_AVX512`` for ``avx512``,
AVX-512 without BF16; else the native ``$LLAMA_CPP_BIN``, which the table's header then names).

llama.cpp runs on each of its weight files (the bundled Q4_1 / Q4_K_M, and Q8_0 / BF16 copies made with
llama-quantize, cached in ~/.cache/tokenmill-bench); its best is the comparison. Every figure is the
median of ``--repeats`` runs. Runs are sequential: never run another benchmark at the same time.

    LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin .venv/bin/python benchmarks/vs_llamacpp.py --isa avx2,auto
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from peers import (
    bundled_gguf,
    cpu_name,
    git_describe,
    llama_batched_bench,
    llama_cpp_tool,
    llama_server,
    requantized,
    run_bench,
    summary,
    tokenmill_server,
)

# The bundled models this script runs, and the weight format of each one's GGUF file.
BUNDLED_KINDS = {"smollm2-135m": "Q4_1", "gemma3-270m": "Q4_K_M"}

# Issue 45's targets (SmolLM2; Gemma 3 270M's single stream: 1.0x, the others as SmolLM2's).
TARGETS = {"single-stream decode": 1.25, "64-seq decode": 2.0, "prefill": 2.0, "server 16 conc": 2.0}
MODEL_TARGETS = {"gemma3-270m": {"single-stream decode": 1.0}}


def tokenmill_offline(args: argparse.Namespace) -> dict[str, float]:
    """Decode and prefill rates of the offline engine, in tokens/s (medians over repeats)."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        enable_prefix_caching=False,
        max_num_seqs=max(64, args.batch),
    )

    def prompts(count: int, salt: int) -> list[dict[str, list[int]]]:
        return [
            {"prompt_token_ids": [100 + (salt * 7919 + i * 131 + j) % 40000 for j in range(128)]}
            for i in range(count)
        ]

    def timed(count: int, max_tokens: int, salt: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts(count, salt), params, use_tqdm=False)
        return time.perf_counter() - start

    timed(4, 8, 0)  # warm-up
    results: dict[str, list[float]] = {"single-stream decode": [], "64-seq decode": [], "prefill": []}
    for repeat in range(args.repeats):
        for count, name in ((1, "single-stream decode"), (args.batch, "64-seq decode")):
            prefill_s = timed(count, 1, 2 * repeat + count)
            total_s = timed(count, args.output_len, 2 * repeat + count)
            results[name].append(count * (args.output_len - 1) / (total_s - prefill_s))
            if count == args.batch:
                results["prefill"].append(count * 128 / prefill_s)
    return {name: statistics.median(values) for name, values in results.items()}


def model_gguf(model: str) -> str:
    """The GGUF file of a bundled model (its package is found, never imported by this script)."""
    if model == "smollm2-135m":
        return bundled_gguf()
    from tokenmill.loader.bundled import locate_bundled

    return locate_bundled(model)


def llama_bench(binary: str, gguf: str, repeats: int) -> dict[str, float]:
    threads = str(os.cpu_count() or 2)
    command = [binary, "-m", gguf, "-t", threads, "-p", "128", "-n", "128", "-r", str(repeats), "-o", "json"]
    rows = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    out: dict[str, float] = {}
    for row in rows:
        name = "prefill" if row["n_prompt"] else "single-stream decode"
        out[name] = float(row["avg_ts"])
    return out


def llama_batched(binary: str, gguf: str, batch: int, output_len: int, repeats: int) -> dict[str, float]:
    rows = [llama_batched_bench(binary, gguf, batch, 128, output_len) for _ in range(repeats)]
    return {
        "64-seq decode": statistics.median(float(row["speed_tg"]) for row in rows),
        "prefill": statistics.median(float(row["speed_pp"]) for row in rows),
    }


def server_rate(url: str, label: str, args: argparse.Namespace) -> float:
    bench_args = [
        "--dataset", "sharegpt", "--num-prompts", str(args.server_prompts),
        "--max-concurrency", "16", "--output-len", "128", "--ignore-eos",
        "--endpoint", "completions", "--num-warmups", "2",
    ]  # fmt: skip
    return float(summary(run_bench(url, label, bench_args))["output_tok_s"])


def tokenmill_path_rates(isa: str, args: argparse.Namespace) -> tuple[str, dict[str, float]]:
    """tokenmill's figures on one ``TOKENMILL_CPU_ISA`` path (``auto``: the CPU's best), and the path
    that ran. The offline engine runs in a child process: the path is fixed per process."""
    env = {**os.environ, "TOKENMILL_CPU_ISA": isa}
    command = [
        sys.executable,
        __file__,
        "--offline-json",
        "--repeats",
        str(args.repeats),
        "--model",
        args.model,
    ]
    command += ["--batch", str(args.batch), "--output-len", str(args.output_len), "--dtype", args.dtype]
    command += ["--quantization", args.quantization] if args.quantization else []
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"tokenmill on path {isa} failed:\n{done.stderr[-4000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    rates: dict[str, float] = report["rates"]
    if not args.skip_server:
        extra = ["--dtype", args.dtype] + (["--quantization", args.quantization] if args.quantization else [])
        previous = os.environ.get("TOKENMILL_CPU_ISA")
        os.environ["TOKENMILL_CPU_ISA"] = isa  # the server process inherits it
        try:
            with tokenmill_server(args.model, extra) as url:
                rates["server 16 conc"] = server_rate(url, "tokenmill", args)
        finally:
            os.environ.pop("TOKENMILL_CPU_ISA")
            if previous is not None:
                os.environ["TOKENMILL_CPU_ISA"] = previous
    return str(report["isa"]), rates


# Per path, the variable naming a llama.cpp build held to that path's instructions: built with
# ``-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF`` (avx2), or ``-DGGML_NATIVE=OFF -DGGML_AVX512=ON
# -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=OFF`` (avx512).
PATH_BUILDS = {"avx2": "LLAMA_CPP_BIN_AVX2", "avx512": "LLAMA_CPP_BIN_AVX512"}


def llama_cpp_folder(isa: str) -> str | None:
    """The llama.cpp build for a path: the one ``PATH_BUILDS`` names where set, else
    ``$LLAMA_CPP_BIN`` (native)."""
    variable = PATH_BUILDS.get(isa)
    if variable and os.environ.get(variable):
        return os.environ[variable]
    return os.environ.get("LLAMA_CPP_BIN")


def tool(folder: str | None, name: str) -> str | None:
    if folder and (Path(folder) / name).exists():
        return str(Path(folder) / name)
    return llama_cpp_tool(name, None)


def llama_cpp_rates(
    folder: str | None, files: dict[str, str], args: argparse.Namespace
) -> dict[str, dict[str, float]]:
    """llama.cpp's figures from the build in ``folder``: workload -> weight file kind -> tokens/s."""
    peer: dict[str, dict[str, float]] = {}
    bench_bin, batched_bin = tool(folder, "llama-bench"), tool(folder, "llama-batched-bench")
    server_bin = tool(folder, "llama-server")
    for kind, path in files.items():
        figures: dict[str, Any] = {}
        if bench_bin:
            figures.update(llama_bench(bench_bin, path, args.repeats))
        if batched_bin:
            batched = llama_batched(batched_bin, path, args.batch, args.output_len, args.repeats)
            figures["64-seq decode"] = batched["64-seq decode"]
            figures["prefill"] = max(figures.get("prefill", 0.0), batched["prefill"])
        if server_bin and not args.skip_server:
            with llama_server(server_bin, path, 16, 2048, ["--no-cache-prompt"]) as url:
                figures["server 16 conc"] = server_rate(url, f"llama-server {kind}", args)
        for name, value in figures.items():
            peer.setdefault(name, {})[kind] = value
    return peer


def print_table(
    isa: str,
    folder: str | None,
    ours: dict[str, float],
    peer: dict[str, dict[str, float]],
    model: str = "smollm2-135m",
) -> None:
    print(f"\npath {isa} (llama.cpp from {folder or 'PATH'})")
    print(f"{'workload':24}{'tokenmill':>12}{'llama.cpp best':>22}{'ratio':>8}{'target':>8}  all llama.cpp")
    for name, target in {**TARGETS, **MODEL_TARGETS.get(model, {})}.items():
        if name not in ours:
            continue
        by_kind = peer.get(name, {})
        if not by_kind:
            print(f"{name:24}{ours[name]:12.1f}{'(no llama.cpp)':>22}")
            continue
        best_kind = max(by_kind, key=lambda k: by_kind[k])
        ratio = ours[name] / by_kind[best_kind]
        others = ", ".join(f"{k} {v:.0f}" for k, v in by_kind.items())
        verdict = "met" if ratio >= target else "NOT met"
        best = f"{by_kind[best_kind]:.1f} ({best_kind})"
        print(f"{name:24}{ours[name]:12.1f}{best:>22}{ratio:7.2f}x{target:6.2f}x {verdict}  {others}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--server-prompts", type=int, default=64)
    parser.add_argument(
        "--dtype", default="auto", help="auto: bfloat16 on the AVX-512 paths, float32 on avx2"
    )
    parser.add_argument("--quantization", default=None, help="tokenmill weight quantization (int8 or int4)")
    parser.add_argument(
        "--weights",
        default="Q8_0,BF16",
        help="llama.cpp weight files to try besides the bundled one (made with llama-quantize)",
    )
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(BUNDLED_KINDS))
    parser.add_argument(
        "--isa",
        default="auto",
        help="comma-separated TOKENMILL_CPU_ISA paths to run a row each for (amx, avx512_bf16, avx512, "
        "avx2; auto: the CPU's best)",
    )
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument("--offline-json", action="store_true", help=argparse.SUPPRESS)  # the child's mode
    args = parser.parse_args()

    if args.offline_json:
        from tokenmill.layers.cpu_isa import cpu_isa

        print(json.dumps({"isa": cpu_isa(), "rates": tokenmill_offline(args)}))
        return
    print(
        f"{args.model} on {cpu_name()}, {os.cpu_count()} cores; tokenmill {git_describe()} ({args.dtype}, {args.quantization or 'default weights: lossless int4 on exactly 4-bit layers'})"
    )
    gguf = model_gguf(args.model)
    files = {BUNDLED_KINDS[args.model]: gguf}
    quantize = tool(os.environ.get("LLAMA_CPP_BIN"), "llama-quantize")
    for kind in args.weights.split(","):
        if kind not in files and quantize is not None:
            files[kind] = requantized(gguf, quantize, kind, Path.home() / ".cache/tokenmill-bench")
    for isa in args.isa.split(","):
        ran, ours = tokenmill_path_rates(isa, args)
        folder = llama_cpp_folder(ran)
        print_table(ran, folder, ours, llama_cpp_rates(folder, files, args), args.model)


if __name__ == "__main__":
    main()
