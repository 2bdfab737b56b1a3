"""A short request sent while another's long, uncached prompt is being prefilled: its time to first token.

A chat follow-up or an agent's next call often lands while the server computes someone's long new
prompt (a document, a retrieved context). Each round sends a cold prompt of about ``--long-words``
words (500: about 2,900 tokens), then ``--delay`` seconds later a one-line question; both stream one
token. Printed per server: the short request's mean and max TTFT and the long one's mean TTFT.

Servers, one at a time: tokenmill as served (on a CPU the short request pauses the long prefill
between layers and runs first, ``step_control.py``), tokenmill with ``--short-prefill-interrupt 0``
(it waits for the prefill), and llama-server on the bundled model when found ($LLAMA_CPP_BIN or
``--llama-server``; two slots, its default batch sizes, BF16 weights by default as in
``shared_prefix.py``; only with the default ``--model``, the model its GGUF holds).

    .venv/bin/python benchmarks/short_behind_long.py [--rounds 8] [--long-words 500] [--delay 0.08]
        [--model smollm2-135m | gemma3-270m]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx
from peers import add_llama_peer_arguments, cpu_name, git_describe, llama_peer, llama_server
from peers import tokenmill_server as tokenmill

CONTEXT = 4096


async def first_token_seconds(client: httpx.AsyncClient, url: str, model: str, prompt: str) -> float:
    """Seconds from sending a streaming one-token completion to its first data line."""
    started = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": True, "temperature": 0}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and "[DONE]" not in line:
                return time.perf_counter() - started
    raise RuntimeError("the stream ended without a token")


async def rounds(url: str, model: str, count: int, long_words: int, delay: float) -> dict[str, float]:
    short_ttfts: list[float] = []
    long_ttfts: list[float] = []
    async with httpx.AsyncClient(timeout=120) as client:
        await first_token_seconds(client, url, model, "Hello there")  # uncounted: first-request costs
        for i in range(count):
            long_prompt = " ".join(f"w{i}x{k}" for k in range(long_words))  # new words: never cached
            long_task = asyncio.create_task(first_token_seconds(client, url, model, long_prompt))
            await asyncio.sleep(delay)
            question = f"Question {i}: what is {i} plus {i}?"
            short_ttfts.append(await first_token_seconds(client, url, model, question))
            long_ttfts.append(await long_task)
    return {
        "short mean ms": 1000 * statistics.fmean(short_ttfts),
        "short max ms": 1000 * max(short_ttfts),
        "long mean ms": 1000 * statistics.fmean(long_ttfts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m", help="the model tokenmill serves")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--long-words", type=int, default=500)
    parser.add_argument(
        "--delay", type=float, default=0.08, help="seconds between the long and the short request"
    )
    add_llama_peer_arguments(parser)
    args = parser.parse_args()
    print(
        f"# {git_describe()} on {cpu_name()}: {args.model}, {args.rounds} rounds, {args.long_words} words, "
        f"{args.delay} s"
    )
    rows: dict[str, dict[str, float]] = {}
    for label, extra in (
        ("tokenmill", []),
        ("tokenmill --short-prefill-interrupt 0", ["--short-prefill-interrupt", "0"]),
    ):
        with tokenmill(args.model, ["--max-model-len", str(CONTEXT), *extra]) as url:
            rows[label] = asyncio.run(rounds(url, args.model, args.rounds, args.long_words, args.delay))
    peer = llama_peer(args) if args.model == "smollm2-135m" else None  # its GGUF is SmolLM2's
    if peer is not None:
        server_bin, gguf, peer_name = peer
        with llama_server(server_bin, gguf, 2, CONTEXT, []) as url:
            rows[peer_name] = asyncio.run(
                rounds(url, "smollm2-135m", args.rounds, args.long_words, args.delay)
            )
    for label, row in rows.items():
        print(f"{label:40s} " + "  ".join(f"{key} {value:8.1f}" for key, value in row.items()))
    base = rows["tokenmill"]["short mean ms"]
    for label, row in rows.items():
        if label != "tokenmill":
            print(f"short request's mean TTFT, {label} / tokenmill: x{row['short mean ms'] / base:.1f}")


if __name__ == "__main__":
    main()
