"""The deterministic mode's cost and what it buys, side by side with the default mode in one run.

For each mode (the same ``--dtype`` and ``--quantization`` for both, so the ratio is the mode's own
cost):

- batched throughput (output tok/s over ``--num-prompts`` random prompts decoded together) and
  single-stream decode speed (one request alone);
- cache-hit agreement: ``--cache-prompts`` ShareGPT first turns, each behind one shared prefix of
  ``--prefix-len`` tokens (ShareGPT text too), answered greedily once with the prefix cache off
  (every prompt computed whole) and once with the prefix already cached (every prompt continues it);
  prints how many greedy outputs differ.

Run under the shared benchmark lock:

    flock /tmp/tokenmill-bench.lock .venv/bin/python benchmarks/deterministic.py
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from tokenmill import LLM, SamplingParams
from tokenmill.bench.datasets import _first_turns
from tokenmill.bench.sharegpt import sharegpt_path


def make_llm(args: argparse.Namespace, deterministic: bool, **kwargs: Any) -> LLM:
    return LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        max_model_len=args.max_model_len,
        deterministic=deterministic,
        **kwargs,
    )


def tokens_per_second(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def speed(args: argparse.Namespace, deterministic: bool) -> tuple[float, float]:
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    llm = make_llm(args, deterministic, enable_prefix_caching=False)
    batched = tokens_per_second(llm, prompts, args.output_len)
    single = tokens_per_second(llm, prompts[:1], args.output_len)
    return batched, single


def cache_prompts(args: argparse.Namespace, llm: LLM) -> list[list[int]]:
    """One shared ``prefix_len``-token prefix (ShareGPT text), then each of ``cache_prompts`` first
    turns (at most 256 tokens each), as token ids."""
    tokenizer = llm.tokenizer
    turns = _first_turns(str(sharegpt_path()))
    prefix: list[int] = []
    while len(prefix) < args.prefix_len:
        prefix += tokenizer.encode(next(turns)[0] + "\n\n", add_special_tokens=False)
    prefix = prefix[: args.prefix_len]
    questions: list[list[int]] = []
    for prompt, _ in turns:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        if 4 <= len(ids) <= 256:
            questions.append(ids)
        if len(questions) == args.cache_prompts:
            break
    return [prefix + q for q in questions]


def cache_disagreements(args: argparse.Namespace, deterministic: bool) -> tuple[int, int]:
    """(greedy outputs that differ with vs without a prefix-cache hit, prompts)."""
    params = SamplingParams(temperature=0, max_tokens=args.cache_output_len, ignore_eos=True)
    cold = make_llm(args, deterministic, enable_prefix_caching=False)
    prompts = cache_prompts(args, cold)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    misses = [o.outputs[0].token_ids for o in cold.generate(inputs, params, use_tqdm=False)]
    del cold
    warm = make_llm(args, deterministic)
    prefix = prompts[0][: args.prefix_len]
    warm.generate([{"prompt_token_ids": prefix}], SamplingParams(max_tokens=1), use_tqdm=False)
    outputs = warm.generate(inputs, params, use_tqdm=False)
    assert all(o.num_cached_tokens >= args.prefix_len - warm.engine.kv_manager.block_size for o in outputs)
    hits = [o.outputs[0].token_ids for o in outputs]
    return sum(a != b for a, b in zip(misses, hits, strict=True)), len(prompts)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4", "none"],
        help="unset: the weights as `make serve` loads them (a GGUF's exactly 4-bit layers on the int4 kernel)",
    )
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--cache-prompts", type=int, default=50)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--cache-output-len", type=int, default=32)
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-cache", action="store_true")
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    for name, deterministic in (("default", False), ("deterministic", True)):
        row: dict[str, float] = {}
        if not args.skip_speed:
            row["batched"], row["single"] = speed(args, deterministic)
            print(
                f"{name}: batched {row['batched']:.1f} tok/s, single stream {row['single']:.1f} tok/s",
                flush=True,
            )
        if not args.skip_cache:
            differ, total = cache_disagreements(args, deterministic)
            print(
                f"{name}: {differ} of {total} greedy outputs differ with vs without a cache hit", flush=True
            )
        results[name] = row
    if not args.skip_speed:
        default, deterministic_row = results["default"], results["deterministic"]
        print(
            f"deterministic / default: batched {deterministic_row['batched'] / default['batched']:.2f}x, "
            f"single stream {deterministic_row['single'] / default['single']:.2f}x"
        )


if __name__ == "__main__":
    main()
