"""Structured outputs: what constraining costs, and what jump-forward saves.

The same prompts run three ways on one engine: unconstrained (EOS ignored, ``--output-len`` tokens
each), constrained by a JSON schema with jump-forward off, and with it on. Prints output tokens/s,
the throughput ratios and how many tokens jump-forward appended without sampling. The grammar is
compiled in a warm-up run, so the timings measure masking and matching, not compilation. Target:
constraining costs at most 10% of throughput.

    .venv/bin/python benchmarks/structured.py [--num-prompts 64] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email"},
        "skills": {
            "type": "array",
            "items": {"type": "string", "maxLength": 16},
            "minItems": 1,
            "maxItems": 4,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "country": {"enum": ["France", "Germany", "Japan", "Brazil", "Canada"]},
            },
            "required": ["city", "country"],
        },
    },
    "required": ["name", "age", "email", "skills", "address"],
}


def run(llm: Any, prompts: list[str], params: Any) -> tuple[float, int]:
    """Output tokens per second and the number of output tokens."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return num_tokens / elapsed, num_tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128, help="max tokens (unconstrained: exact)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    args = parser.parse_args()

    from tokenmill import LLM, SamplingParams
    from tokenmill.sampling_params import StructuredOutputsParams

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, enable_prefix_caching=False)
    prompts = [
        f"Invent person number {i} and describe them as a JSON object: " for i in range(args.num_prompts)
    ]
    free = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0,
        max_tokens=args.output_len,
        structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA)),
    )
    print(
        f"workload: {args.num_prompts} prompts, up to {args.output_len} output tokens, {args.model}, "
        f"{args.dtype}, {torch.get_num_threads()} threads"
    )
    llm.generate(prompts[:2], [free, constrained], use_tqdm=False)  # warm-up, compiles the grammar

    free_rate, free_tokens = run(llm, prompts, free)
    print(f"unconstrained          : {free_rate:8.1f} output tok/s ({free_tokens} tokens)")

    manager = llm.engine.structured
    scheduler = llm.engine.scheduler
    manager.jump_forward = False
    off_rate, off_tokens = run(llm, prompts, constrained)
    print(f"json schema, no jump   : {off_rate:8.1f} output tok/s ({off_tokens} tokens)")

    manager.jump_forward = True
    forced_before = scheduler.num_forced_tokens_total
    on_rate, on_tokens = run(llm, prompts, constrained)
    forced = scheduler.num_forced_tokens_total - forced_before
    print(f"json schema, jump      : {on_rate:8.1f} output tok/s ({on_tokens} tokens, {forced} forced)")

    print(f"constrained / free     : {off_rate / free_rate:8.2f}x  (target >= 0.90)")
    print(f"jump / no jump         : {on_rate / off_rate:8.2f}x")
    print(f"forced tokens          : {forced / max(on_tokens, 1):8.1%} of the constrained output")


if __name__ == "__main__":
    main()
