"""Command-line options for the engine, shared by ``tokenmill serve``, ``generate`` and ``chat``.

Defaults come from the config dataclasses so there is one source for each of them.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from tokenmill.config import (
    ADMISSIONS,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    DTYPE_CHOICES,
    EXECUTOR_BACKENDS,
    LOGPROBS_MODES,
    MODEL_IMPLS,
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    TierConfig,
    standard_tiers,
)
from tokenmill.core.policy import POLICIES

_BYTE_SUFFIXES = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def _memory(value: str) -> int | float:
    """``2000000000``, ``4G`` or ``512MiB`` is bytes; ``0.3`` is a fraction of available memory."""
    text = value.strip().lower().removesuffix("ib").removesuffix("b")
    if text and text[-1] in _BYTE_SUFFIXES:
        return int(float(text[:-1]) * _BYTE_SUFFIXES[text[-1]])
    number = float(text)
    if number.is_integer() and number > 1:
        return int(number)
    return number


_TIER_KEYS = {"max_running": int, "step_share": float, "max_waiting": int}
_SLO_KEYS = {"ttft": "ttft_slo", "tpot": "tpot_slo"}


def _key_values(text: str, option: str) -> tuple[str, dict[str, str]]:
    """``name:key=value,key=value`` → ``(name, {key: value})``; ArgumentTypeError when malformed."""
    name, _, rest = text.partition(":")
    values: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise argparse.ArgumentTypeError(f"{option}: expected key=value, got {item!r} in {text!r}")
        values[key.strip()] = value.strip()
    if not name:
        raise argparse.ArgumentTypeError(f"{option}: a tier name is required, got {text!r}")
    return name, values


def parse_tier(text: str) -> TierConfig:
    """``--tier flex:max_running=4,step_share=0.25,max_waiting=100`` → a ``TierConfig``."""
    name, values = _key_values(text, "--tier")
    fields: dict[str, int | float] = {}
    for key, value in values.items():
        if key not in _TIER_KEYS:
            raise argparse.ArgumentTypeError(f"--tier: unknown key {key!r}; use {', '.join(_TIER_KEYS)}")
        try:
            fields[key] = _TIER_KEYS[key](value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--tier: {key} must be a number, got {value!r}") from None
    return TierConfig(name, **fields)  # type: ignore[arg-type]


def parse_tier_slo(text: str) -> tuple[str, dict[str, float]]:
    """``--tier-slo priority:ttft=0.5,tpot=0.05`` (seconds) → ``("priority", {"ttft_slo": 0.5, ...})``."""
    name, values = _key_values(text, "--tier-slo")
    targets: dict[str, float] = {}
    for key, value in values.items():
        if key not in _SLO_KEYS:
            raise argparse.ArgumentTypeError(f"--tier-slo: unknown target {key!r}; use ttft or tpot")
        try:
            targets[_SLO_KEYS[key]] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--tier-slo: {key} must be seconds, got {value!r}") from None
    if not targets:
        raise argparse.ArgumentTypeError(f"--tier-slo: give ttft=SECONDS and/or tpot=SECONDS, got {text!r}")
    return name, targets


def parse_lora_module(text: str) -> tuple[str, str]:
    """``--lora-modules sql=/adapters/sql`` → ``("sql", "/adapters/sql")``."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules: expected NAME=PATH, got {text!r}")
    return name, path


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """``--speculative-config '{"method": "ngram", ...}'`` → a validated ``SpeculativeConfig``."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--speculative-config: not JSON: {exc}") from None
    if not isinstance(values, dict):
        raise argparse.ArgumentTypeError(f"--speculative-config: expected a JSON object, got {text!r}")
    try:
        config = SpeculativeConfig.from_dict(values)
        config.validate()
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"--speculative-config: {exc}") from None
    return config


def parse_user_weight(text: str) -> tuple[str, float]:
    """``--user-weight alice=2`` → ``("alice", 2.0)``."""
    user, sep, value = text.rpartition("=")
    try:
        if not sep or not user:
            raise ValueError
        return user, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--user-weight: expected USER=WEIGHT, got {text!r}") from None


def build_tiers(
    tiers: list[TierConfig] | None, slos: list[tuple[str, dict[str, float]]] | None
) -> list[TierConfig]:
    """The tier list: ``--tier`` options (or the standard tiers) with ``--tier-slo`` targets applied."""
    result = list(tiers) if tiers else standard_tiers()
    by_name = {tier.name: tier for tier in result}
    for name, targets in slos or []:
        if name not in by_name:
            raise ValueError(
                f"--tier-slo names tier {name!r}, which is not configured ({', '.join(by_name)})"
            )
        for field_name, seconds in targets.items():
            setattr(by_name[name], field_name, seconds)
    return result


# Where a decode pass takes tens of milliseconds (CPUs), a prompt this short is worth cutting one for.
CPU_SHORT_PREFILL_INTERRUPT = 256
# On CPUs the engine's passes and the server's work share the cores; the server's comes first.
CPU_ENGINE_NICENESS = 5


def on_cpu_default(value: int | None, device: str, cpu_default: int) -> int:
    """An option that defaults to ``cpu_default`` on CPUs and 0 on accelerators: as given, else that."""
    if value is not None:
        return value
    return cpu_default if device.split(":")[0] == "cpu" else 0


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the model, KV-cache and scheduler option groups to ``parser``."""
    model = parser.add_argument_group("model")
    model.add_argument("--dtype", default=ModelConfig.dtype, choices=DTYPE_CHOICES)
    model.add_argument(
        "--max-model-len", type=int, default=None, help="context window (default: the model's)"
    )
    model.add_argument("--seed", type=int, default=ModelConfig.seed)
    model.add_argument("--device", default=ModelConfig.device)
    model.add_argument(
        "--model-impl",
        default=ModelConfig.model_impl,
        choices=list(MODEL_IMPLS),
        help="native (ours), transformers (its model code over our paged KV cache), auto (native if we have it)",
    )
    model.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4", "none"],
        help="opt-in weight-only int8 or int4 (groups of 32) linear layers (CPU, bfloat16); see "
        "docs/performance.md for speed and quality. Unset, a GGUF's exactly 4-bit layers use the int4 "
        "kernel (same values, lossless); none turns that off",
    )
    model.add_argument("--num-threads", type=int, default=None, help="torch CPU threads for the engine")
    model.add_argument(
        "--engine-niceness",
        type=int,
        default=None,
        help="lower the engine process's CPU priority by this much (nice 0-19), so the server's short "
        f"bursts of work (HTTP, tokenizing, streaming) never wait behind its passes (default: "
        f"{CPU_ENGINE_NICENESS} on CPUs, 0 elsewhere)",
    )
    add_tensor_parallel_args(model)
    model.add_argument(
        "--executor-backend",
        default="inprocess",
        choices=list(EXECUTOR_BACKENDS),
        help="inprocess runs the model in the engine's process; mp in one worker child process that "
        "gets each step's plan as a delta (the base of tensor parallelism)",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant outputs: a request's tokens and logprobs do not depend on other requests, "
        "chunk sizes, prefix-cache hits or preemption (needs --dtype float32; slower)",
    )
    model.add_argument(
        "--speculative-config",
        type=parse_speculative_config,
        default=None,
        metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' (keys: method, '
        "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, draft_confidence, adaptive); "
        "greedy output is unchanged, seeded output too with ngram",
    )
    cache = parser.add_argument_group("KV cache")
    cache.add_argument("--block-size", type=int, default=CacheConfig.block_size)
    cache.add_argument(
        "--kv-cache-memory",
        type=_memory,
        default=CacheConfig.kv_cache_memory,
        help="bytes for the KV cache (4G, 512MiB, 2000000000; a number <= 1 is a fraction of available "
        "memory). Default: what max_num_seqs × max_model_len tokens need, capped by "
        "--kv-cache-memory-fraction",
    )
    cache.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=CacheConfig.kv_cache_memory_fraction,
        help="the most of the available memory the default KV cache takes",
    )
    cache.add_argument(
        "--num-blocks", type=int, default=None, help="exact number of KV blocks (overrides memory)"
    )
    cache.add_argument("--no-prefix-cache", action="store_true", help="disable the radix prefix cache")
    cache.add_argument(
        "--state-checkpoint-interval",
        type=int,
        default=None,
        help="recurrent-state models: snapshot a prompt's state into the prefix cache every this many "
        "tokens (a multiple of the block size; default 4 blocks), besides the end of every prompt",
    )
    cache.add_argument(
        "--num-state-slots",
        type=int,
        default=None,
        help="recurrent-state models: state slots for running sequences and prefix-cache snapshots "
        "(default: two per --max-num-seqs)",
    )
    cache.add_argument(
        "--kv-cache-dtype",
        default=CacheConfig.kv_cache_dtype,
        choices=DTYPE_CHOICES,
        help="the KV cache's element type (auto: the model's dtype); a 16-bit cache under a float32 "
        "model holds twice the tokens and rounds keys and values to 16 bits",
    )
    cache.add_argument(
        "--kv-prefault",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="map the KV cache's pages ahead of use while the engine is idle, so steps stop less for "
        "page faults on new blocks (resident memory grows to the whole pool; default: on CPUs, where "
        "the cache is a lazily mapped memory map)",
    )
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
        "--admission",
        default="ttft",
        choices=sorted(ADMISSIONS),
        help="how many waiting requests a step admits: ttft (default here) as many as keep their mean "
        "time to first token least; fill (the Python API's default) as many as the token budget holds",
    )
    scheduler.add_argument(
        "--first-token-pass",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run a step that finishes prompts beside other work in two passes, the finishing prefills "
        "first, so their first tokens do not wait for the decodes (default here; off in the Python API)",
    )
    scheduler.add_argument(
        "--short-prefill-interrupt",
        type=int,
        default=None,
        metavar="TOKENS",
        help="a request whose prompt needs at most TOKENS tokens computed beyond the prefix cache pauses "
        "the step in flight between layers and runs first, so it waits for no decode pass or long "
        "prefill (default here: "
        f"{CPU_SHORT_PREFILL_INTERRUPT} on CPUs, 0 elsewhere; 0 turns it off; off in the Python API)",
    )
    scheduler.add_argument(
        "--max-waiting", type=int, default=None, help="waiting-queue bound; requests beyond it get 429"
    )
    tiers = parser.add_argument_group("service tiers and fairness")
    tiers.add_argument(
        "--tier",
        action="append",
        type=parse_tier,
        default=None,
        metavar="NAME[:max_running=N,step_share=F,max_waiting=N]",
        help="a service tier, best first (repeat; must include 'default'; default: priority, default, flex)",
    )
    tiers.add_argument(
        "--tier-slo",
        action="append",
        type=parse_tier_slo,
        default=None,
        metavar="NAME:ttft=S,tpot=S",
        help="latency targets of a tier; a TTFT target keeps worse tiers' steps short and gives a first "
        "token steps of its own; about to miss a target, worse tiers also get less of each step",
    )
    tiers.add_argument(
        "--slo-guard-share",
        type=float,
        default=SchedulerConfig.slo_guard_share,
        help="share of a step worse tiers keep while a better tier is at risk of missing its target",
    )
    tiers.add_argument(
        "--ttft-step-fraction",
        type=float,
        default=SchedulerConfig.ttft_step_fraction,
        help="while a tier has a TTFT target, worse tiers' prefill chunks are cut so a step is "
        "predicted to take at most this fraction of the tightest target",
    )
    tiers.add_argument(
        "--max-exclusive-steps",
        type=int,
        default=SchedulerConfig.max_exclusive_steps,
        help="most steps in a row that serve only a tier whose request awaits its first token within "
        "a TTFT target (and better tiers); 0 never skips worse tiers",
    )
    tiers.add_argument(
        "--user-weight",
        action="append",
        type=parse_user_weight,
        default=None,
        metavar="USER=WEIGHT",
        help="fair-share weight of a user under --policy vtc (repeat; others weigh 1)",
    )
    tiers.add_argument(
        "--fair-input-weight",
        type=float,
        default=SchedulerConfig.fair_input_weight,
        help="vtc cost of a prompt token",
    )
    tiers.add_argument(
        "--fair-output-weight",
        type=float,
        default=SchedulerConfig.fair_output_weight,
        help="vtc cost of a generated token",
    )
    lora = parser.add_argument_group("LoRA adapters")
    lora.add_argument(
        "--enable-lora", action="store_true", help="serve PEFT LoRA adapters beside the base model"
    )
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=None,
        metavar="NAME=PATH",
        help="adapters to load at start-up; a request picks one by model=NAME",
    )
    lora.add_argument(
        "--max-loras", type=int, default=LoRAConfig.max_loras, help="adapters one step may mix (device slots)"
    )
    lora.add_argument(
        "--max-lora-rank", type=int, default=LoRAConfig.max_lora_rank, help="largest adapter rank"
    )
    lora.add_argument(
        "--max-cpu-loras", type=int, default=None, help="adapters kept read on the CPU (default: --max-loras)"
    )
    scheduler.add_argument(
        "--no-jump-forward",
        action="store_true",
        help="sample every token of structured outputs, even where the grammar allows only one",
    )
    scheduler.add_argument(
        "--logprobs-mode",
        choices=LOGPROBS_MODES,
        default="raw_logprobs",
        help="what sampled tokens' logprobs describe: the model's distribution (raw) or the one sampled "
        "from, after penalties, bias, temperature, top-k/top-p/min-p (processed)",
    )
    scheduler.add_argument(
        "--rl-exact-logprobs",
        action="store_true",
        help="compute in float32 so logprobs equal a float32 transformers recompute within 1e-4 (RL)",
    )


def add_tensor_parallel_args(group: argparse._ArgumentGroup) -> None:
    """``--tensor-parallel-size``, ``--threads-per-rank``, ``--distributed-executor-backend``."""
    group.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="shard the model over this many worker processes joined by torch.distributed (gloo on "
        "CPU, nccl on CUDA); docs/scaling-tp.md",
    )
    group.add_argument(
        "--threads-per-rank",
        type=int,
        default=None,
        help="CPU threads of each tensor-parallel rank (default: --num-threads, else every core, "
        "split evenly over the ranks)",
    )
    group.add_argument(
        "--distributed-executor-backend",
        default="mp",
        choices=list(DISTRIBUTED_EXECUTOR_BACKENDS),
        help="mp: tensor-parallel workers as child processes; ray: as Ray actors in a placement group "
        "(pip install tokenmill[ray])",
    )
    group.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="under tensor parallelism, give each rank whole experts of the MoE layers (experts / "
        "ranks each) instead of a slice of every expert",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed engine options as keyword arguments for ``LLM`` / ``build_engine_config``.

    Raises ValueError when ``--tier-slo`` names a tier that is not configured.
    """
    return {
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "seed": args.seed,
        "device": args.device,
        "model_impl": args.model_impl,
        "quantization": args.quantization,
        "num_threads": args.num_threads,
        "engine_niceness": on_cpu_default(args.engine_niceness, args.device, CPU_ENGINE_NICENESS),
        "block_size": args.block_size,
        "kv_cache_memory": args.kv_cache_memory,
        "kv_cache_memory_fraction": args.kv_cache_memory_fraction,
        "num_blocks": args.num_blocks,
        "enable_prefix_caching": not args.no_prefix_cache,
        "kv_cache_dtype": args.kv_cache_dtype,
        "prefault": bool(on_cpu_default(args.kv_prefault, args.device, 1)),
        "state_checkpoint_interval": args.state_checkpoint_interval,
        "num_state_slots": args.num_state_slots,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "policy": args.policy,
        "admission": args.admission,
        "first_token_pass": args.first_token_pass,
        "short_prefill_interrupt": on_cpu_default(
            args.short_prefill_interrupt, args.device, CPU_SHORT_PREFILL_INTERRUPT
        ),
        "max_waiting": args.max_waiting,
        "tiers": build_tiers(args.tier, args.tier_slo),
        "slo_guard_share": args.slo_guard_share,
        "ttft_step_fraction": args.ttft_step_fraction,
        "max_exclusive_steps": args.max_exclusive_steps,
        "user_weights": dict(args.user_weight or []),
        "fair_input_weight": args.fair_input_weight,
        "fair_output_weight": args.fair_output_weight,
        "jump_forward": not args.no_jump_forward,
        "executor_backend": args.executor_backend,
        "tensor_parallel_size": args.tensor_parallel_size,
        "threads_per_rank": args.threads_per_rank,
        "distributed_executor_backend": args.distributed_executor_backend,
        "enable_expert_parallel": args.enable_expert_parallel,
        "logprobs_mode": args.logprobs_mode,
        "rl_exact_logprobs": args.rl_exact_logprobs,
        "deterministic": args.deterministic,
        "enable_lora": args.enable_lora or bool(args.lora_modules),
        "lora_modules": dict(args.lora_modules or []),
        "max_loras": args.max_loras,
        "max_lora_rank": args.max_lora_rank,
        "max_cpu_loras": args.max_cpu_loras,
        "speculative_config": args.speculative_config,
    }
