"""Cold start: seconds from running `tokenmill serve <model>` to the first completed token.

Starts the server as a user would, sends a one-token completion as soon as the port accepts
connections (retrying only while the server is still starting), and prints the elapsed time. Runs
``--runs`` times; the first run after an install may include one-time work (converting the GGUF,
compiling the CPU kernels), which later starts skip.

    .venv/bin/python benchmarks/cold_start.py [--model smollm2-135m] [--runs 3]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import httpx
from peers import free_port


def one_start(model: str, extra: list[str]) -> float:
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/completions"
    command = [sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING", "serve", model]
    command += ["--host", "127.0.0.1", "--port", str(port), *extra]
    start = time.perf_counter()
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with code {process.returncode}")
            try:
                reply = httpx.post(url, json={"model": model, "prompt": "Hello", "max_tokens": 1}, timeout=60)
                if reply.status_code == 200:
                    return time.perf_counter() - start
            except httpx.TransportError:
                pass
            time.sleep(0.05)  # polling a starting server, bounded by the loop's own exit conditions
            if time.perf_counter() - start > 300:
                raise RuntimeError("no token within 300 s")
    finally:
        process.terminate()
        process.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--serve-args", default="", help="extra `tokenmill serve` arguments")
    args = parser.parse_args()
    times = [one_start(args.model, args.serve_args.split()) for _ in range(args.runs)]
    print(
        f"cold start of `tokenmill serve {args.model}` to first token: "
        + ", ".join(f"{t:.1f} s" for t in times)
    )
    print(f"best {min(times):.1f} s (target <= 10 s)")


if __name__ == "__main__":
    main()
