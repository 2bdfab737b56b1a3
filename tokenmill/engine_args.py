"""Command-line options for the engine, shared by ``tokenmill serve``, ``generate`` and ``chat``.

Defaults come from the config dataclasses so there is one source for each of them.
"""

from __future__ import annotations

import argparse
from typing import Any

from tokenmill.config import CacheConfig, ModelConfig, SchedulerConfig
from tokenmill.core.policy import POLICIES


def _memory(value: str) -> int | float:
    """``0.3`` is a fraction of available memory; ``2000000000`` is bytes."""
    number = float(value)
    if number.is_integer() and number > 1:
        return int(number)
    return number


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the model, KV-cache and scheduler option groups to ``parser``."""
    model = parser.add_argument_group("model")
    model.add_argument(
        "--dtype", default=ModelConfig.dtype, choices=["auto", "float32", "bfloat16", "float16"]
    )
    model.add_argument(
        "--max-model-len", type=int, default=None, help="context window (default: the model's)"
    )
    model.add_argument("--seed", type=int, default=ModelConfig.seed)
    model.add_argument("--device", default=ModelConfig.device)
    model.add_argument("--num-threads", type=int, default=None, help="torch CPU threads for the engine")
    cache = parser.add_argument_group("KV cache")
    cache.add_argument("--block-size", type=int, default=CacheConfig.block_size)
    cache.add_argument(
        "--kv-cache-memory",
        type=_memory,
        default=CacheConfig.kv_cache_memory,
        help="fraction of available memory (<= 1) or bytes",
    )
    cache.add_argument(
        "--num-blocks", type=int, default=None, help="exact number of KV blocks (overrides memory)"
    )
    cache.add_argument("--no-prefix-cache", action="store_true", help="disable the radix prefix cache")
    scheduler = parser.add_argument_group("scheduler")
    scheduler.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=SchedulerConfig.max_num_batched_tokens,
        help="token budget per step (chunked prefill splits prompts to fit)",
    )
    scheduler.add_argument(
        "--max-num-seqs",
        type=int,
        default=SchedulerConfig.max_num_seqs,
        help="most sequences running at once",
    )
    scheduler.add_argument(
        "--policy", default=SchedulerConfig.policy, choices=sorted(POLICIES), help="waiting-queue order"
    )
    scheduler.add_argument(
        "--max-waiting", type=int, default=None, help="waiting-queue bound; requests beyond it get 429"
    )
    scheduler.add_argument(
        "--no-jump-forward",
        action="store_true",
        help="sample every token of structured outputs, even where the grammar allows only one",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed engine options as keyword arguments for ``LLM`` / ``build_engine_config``."""
    return {
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "seed": args.seed,
        "device": args.device,
        "num_threads": args.num_threads,
        "block_size": args.block_size,
        "kv_cache_memory": args.kv_cache_memory,
        "num_blocks": args.num_blocks,
        "enable_prefix_caching": not args.no_prefix_cache,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "policy": args.policy,
        "max_waiting": args.max_waiting,
        "jump_forward": not args.no_jump_forward,
    }
