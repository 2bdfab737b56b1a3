"""Engine, cache and scheduler configuration. All environment-variable reads live here; no torch.

Every field has a default that works on a small CPU machine; ``EngineConfig.validate`` raises
``ValueError`` naming the field for values that cannot work.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

# How a step sizes its admissions (``SchedulerConfig.admission``; the rules are in
# ``core/admission.py``). The names live here so that the config needs nothing of the core.
ADMISSIONS: tuple[str, ...] = ("fill", "ttft")


def env_int(name: str, default: int) -> int:
    """An integer environment variable, or ``default`` when unset."""
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as exc:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from exc


ATTENTION_BACKENDS = ("auto", "torch", "cpu")
MODEL_IMPLS = ("auto", "native", "transformers")
# The activation dtypes (--dtype) and KV cache element types (--kv-cache-dtype); auto: see each.
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
# What a request without a service tier (or with OpenAI's ``auto``) runs in.
AUTO_TIER = "auto"
DEFAULT_TIER = "default"
EXECUTOR_BACKENDS = ("inprocess", "mp")
# What runs a tensor-parallel group's workers: child processes, or Ray actors (executor/ray_executor.py).
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")
# What runs a data-parallel server's replicas: engine processes, or Ray actors (core/dp_ray.py).
DATA_PARALLEL_BACKENDS = ("mp", "ray")
# What the logprobs of sampled tokens describe (vLLM's names): the model's distribution
# (log-softmax of the unprocessed logits), or the one the token was drawn from (after logit bias,
# penalties, grammar, temperature, min-p, top-k and top-p; greedy rows: before temperature).
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


def attention_backend_choice() -> str:
    """``TOKENMILL_ATTENTION_BACKEND``: ``auto`` (the default) lets each device pick its fastest
    attention backend; ``torch`` forces the reference backend, ``cpu`` the C++ CPU kernel."""
    value = os.environ.get("TOKENMILL_ATTENTION_BACKEND") or "auto"
    if value not in ATTENTION_BACKENDS:
        raise ValueError(f"TOKENMILL_ATTENTION_BACKEND must be one of {ATTENTION_BACKENDS}, got {value!r}")
    return value


def fused_cpu_ops_enabled() -> bool:
    """``TOKENMILL_FUSED_CPU_OPS``: ``1`` (the default) uses the fused C++ norm/rotary/activation ops
    for bfloat16 on CPU; ``0`` keeps the unfused torch ops (for comparisons and debugging)."""
    value = os.environ.get("TOKENMILL_FUSED_CPU_OPS") or "1"
    if value not in ("0", "1"):
        raise ValueError(f"TOKENMILL_FUSED_CPU_OPS must be 0 or 1, got {value!r}")
    return value == "1"


def recurrent_kernels_enabled() -> bool:
    """``TOKENMILL_RECURRENT_KERNELS``: ``1`` (the default) runs the hybrid models' convolution, gated
    delta rule and Mamba-2 scan on the C++ CPU kernels (``layers/recurrent_kernel.py``) for float32 and
    bfloat16 activations; ``0`` keeps the torch reference (for comparisons and debugging)."""
    value = os.environ.get("TOKENMILL_RECURRENT_KERNELS") or "1"
    if value not in ("0", "1"):
        raise ValueError(f"TOKENMILL_RECURRENT_KERNELS must be 0 or 1, got {value!r}")
    return value == "1"


# The CPU kernels' instruction-set paths, best first (``layers/cpu_isa.py`` maps each to compile flags).
CPU_ISAS = ("amx", "avx512_bf16", "avx512", "avx2")


def cpu_isa_choice() -> str | None:
    """``TOKENMILL_CPU_ISA``: the instruction set the CPU kernels (and torch's own kernels) are held
    to, one of :data:`CPU_ISAS`; None (unset or ``auto``) means the best this CPU has. Whether the CPU
    can run the choice is checked where the kernels are built (``layers/cpu_isa.py``)."""
    value = os.environ.get("TOKENMILL_CPU_ISA") or "auto"
    if value == "auto":
        return None
    if value not in CPU_ISAS:
        raise ValueError(f"TOKENMILL_CPU_ISA must be auto or one of {CPU_ISAS}, got {value!r}")
    return value


def cache_root() -> str:
    """tokenmill's cache folder: ``$TOKENMILL_CACHE_DIR``, by default ``$XDG_CACHE_HOME/tokenmill``
    (``~/.cache/tokenmill``)."""
    return os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "tokenmill"
    )


def extension_cache_dir() -> str:
    """Where compiled C++ kernels are cached: ``<cache_root()>/extensions``."""
    return os.path.join(cache_root(), "extensions")


def model_cache_dir() -> str:
    """Where model files tokenmill derives are cached: ``<cache_root()>/models`` (bundled GGUF files
    assembled from chunk packages; the config, tokenizer and whole model converted from a GGUF)."""
    return os.path.join(cache_root(), "models")


def gguf_conversion_enabled() -> bool:
    """``TOKENMILL_CONVERT_GGUF``: ``1`` (the default) converts a GGUF once and starts from the
    converted folder afterwards (loader/converted_cache.py); ``0`` always reads the GGUF itself."""
    value = os.environ.get("TOKENMILL_CONVERT_GGUF") or "1"
    if value not in ("0", "1"):
        raise ValueError(f"TOKENMILL_CONVERT_GGUF must be 0 or 1, got {value!r}")
    return value == "1"


@dataclass
class ModelConfig:
    """Which model to run and in what precision.

    ``model`` is a bundled alias (``smollm2-135m``), a Hugging Face folder or a ``.gguf`` file.
    ``dtype`` is ``auto`` (bfloat16 where the CPU or GPU supports it well, else float32),
    ``float32`` or ``bfloat16``. ``max_model_len`` caps prompt + output tokens per sequence; None
    takes the model's own limit. ``model_impl`` chooses the model code: ``native`` (ours; an
    architecture we lack is a ValueError), ``transformers`` (transformers' modelling code over our
    paged KV cache, for any architecture it can route), ``auto`` (native when we have it, else
    transformers). ``quantization`` is None (weights as loaded: on CPU in bfloat16, the linear layers
    of a GGUF whose values are exactly 4-bit groups, as Q4_0/Q4_1 files hold them, keep that int4 copy
    for small steps, which computes with the same values; lossless, so not a quantization), ``none``
    (weights as loaded, never int4), ``int8`` or ``int4`` (opt-in weight-only int8, or int4 in groups
    of 32, for the native models' linear layers on CPU in bfloat16; see layers/quantization.py and
    layers/int4.py).
    """

    model: str = "smollm2-135m"
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    device: str = "cpu"
    served_model_name: str | None = None
    model_impl: str = "auto"
    quantization: str | None = None


@dataclass
class CacheConfig:
    """KV cache sizing.

    ``kv_cache_memory`` is a byte budget (an int) or, when a float in (0, 1], the fraction of the
    machine's available memory to give to KV blocks. None (the default) sizes the pool from what
    the scheduler can use, ``max_num_seqs × max_model_len`` tokens, capped at
    ``kv_cache_memory_fraction`` of the available memory. ``num_blocks`` overrides all of them
    (tests use it).
    ``kv_cache_dtype`` is the cache's element type: ``auto`` (the model's dtype), ``float32``,
    ``bfloat16`` or ``float16``. A 16-bit cache under a float32 model holds twice the tokens in the
    same memory and halves the bytes attention reads; keys and values are rounded to it as they are
    stored, and attention computes in float32 as before (opt-in: outputs then differ from a float32
    cache's by that rounding).
    ``prefault``: on a CPU the cache is an anonymous memory map whose pages the kernel maps on first
    write; with ``prefault`` the server's engine maps them ahead of use whenever it is idle, a few
    blocks at a time in the order the pool hands them out (``worker/kv_cache.py``,
    ``IdlePrefaulter``), so steps stop less for page faults on new blocks (a prompt's blocks stay in
    the prefix cache, so new work lands on untouched memory until the pool is full). Start-up is
    unchanged; only a couple of steps' worth of blocks beyond the highest one written are mapped
    ahead, so resident memory follows use rather than growing to the whole pool. ``tokenmill serve``'s
    default on CPUs; ``LLM`` never idles, so it has no effect there.
    """

    block_size: int = 16
    kv_cache_memory: int | float | None = None
    kv_cache_memory_fraction: float = 0.25
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    prefault: bool = False
    # Models with a recurrent state per sequence (linear attention): how many state slots to keep
    # (None: two per running sequence, one for it and one for prefix-cache snapshots), and every how
    # many tokens a prompt's state is snapshot into the prefix cache (None: every 4 blocks).
    num_state_slots: int | None = None
    state_checkpoint_interval: int | None = None


@dataclass
class LoRAConfig:
    """Multi-LoRA serving (``lora/``): ``enable_lora`` wraps the model's projections; adapters go in
    ``max_loras`` device slots (a step mixes at most that many adapters, plus the base) of rank up
    to ``max_lora_rank``, from a CPU cache of ``max_cpu_loras`` (None: ``max_loras``).
    ``lora_modules`` maps names to PEFT adapter folders loaded at start-up."""

    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None
    lora_modules: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        if not self.enable_lora:
            if self.lora_modules:
                raise ValueError("lora_modules needs enable_lora")
            return
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(
                f"max_loras and max_lora_rank must be >= 1, got {self.max_loras}, {self.max_lora_rank}"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")


@dataclass
class TierConfig:
    """One service tier (a scheduling class OpenAI's ``service_tier`` names).

    ``max_running`` caps its running sequences; ``step_share`` is the fraction of each step's token
    budget its requests may use together; ``max_waiting`` bounds its waiting queue (over it: 429).
    ``ttft_slo`` and ``tpot_slo`` (seconds) are optional latency targets. While a tier has a TTFT
    target, worse tiers' prefill chunks are cut so each step is predicted to take at most
    ``SchedulerConfig.ttft_step_fraction`` of it, and a request of the tier waiting for its first
    token gets steps of its own (``max_exclusive_steps``); when a request is about to miss a target,
    lower tiers are also held to ``SchedulerConfig.slo_guard_share`` of the step.
    """

    name: str
    max_running: int | None = None
    step_share: float = 1.0
    max_waiting: int | None = None
    ttft_slo: float | None = None
    tpot_slo: float | None = None


def standard_tiers() -> list[TierConfig]:
    """OpenAI's tiers, best first: ``priority``, ``default`` (also what ``auto`` means), ``flex``."""
    return [TierConfig("priority"), TierConfig("default"), TierConfig("flex")]


@dataclass
class SchedulerConfig:
    """Batching limits, the waiting-queue policy, service tiers and fairness.

    ``max_num_batched_tokens`` is the per-step token budget (chunked prefill splits prompts to fit);
    ``max_num_seqs`` caps running sequences; ``policy`` names the order inside a scheduling class
    (``fcfs``, ``lpm`` or ``vtc``). ``admission`` says how many waiting requests a step admits:
    ``fill`` while the budget lasts (the most work per step: offline batches), ``ttft`` as many as
    keep the waiting requests' mean time to first token least (``core/admission.py``; the CLI's
    default, for servers). ``max_waiting`` bounds the whole waiting queue (None: unbounded)
    so servers can answer 429. ``tiers`` lists the service tiers best first; ``default`` must be
    one of them. ``vtc`` charges each user ``fair_input_weight`` per prompt token computed and
    ``fair_output_weight`` per generated token, divided by the user's weight in ``user_weights``
    (1 when absent). ``slo_margin`` is the fraction of a latency target at which a tier counts as
    about to miss it. While a tier has a TTFT target, the tiers worse than it get prefill chunks no
    larger than keeps a step's predicted time within ``ttft_step_fraction`` of the tightest TTFT
    target (``core/step_time.py`` predicts it) and within the median of that tier's recent
    first-token steps of their own, and a step where a request of that tier waits for
    its first token serves only that tier and better ones, at most ``max_exclusive_steps`` steps in
    a row (0: never) before a step serves everyone. ``first_token_pass`` runs a step that finishes
    prompts beside other work in two passes, the finishing prefills first, so that their first
    tokens go out without waiting for the rest (``core/first_token_pass.py``; the CLI's default).
    ``short_prefill_interrupt`` (0: off, the Python API's default): a request whose prompt needs at
    most this many tokens computed beyond the prefix cache (as the server estimates it,
    ``frontend/step_cuts.py``) pauses the step in flight between layers and runs in a pass of its
    own before the step goes on (``step_control.py``), so a follow-up turn or an agent's next call
    waits neither for a decode pass nor for another's long prefill (the CLI's default: 256 tokens on
    CPUs, where a pass takes tens to hundreds of milliseconds; 0 on accelerators).
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    policy: str = "fcfs"
    admission: str = "fill"
    max_waiting: int | None = None
    tiers: list[TierConfig] = field(default_factory=standard_tiers)
    user_weights: dict[str, float] = field(default_factory=dict)
    fair_input_weight: float = 1.0
    fair_output_weight: float = 2.0
    slo_guard_share: float = 0.25
    slo_margin: float = 0.8
    ttft_step_fraction: float = 1 / 3
    max_exclusive_steps: int = 4
    first_token_pass: bool = False
    short_prefill_interrupt: int = 0

    def ttft_target_tiers(self) -> set[str]:
        """The names of the tiers with a TTFT target (steps may be cut for their arrivals)."""
        return {tier.name for tier in self.tiers if tier.ttft_slo is not None}

    def resolve_tier(self, name: str | None) -> str:
        """The tier a requested ``service_tier`` runs in (``auto`` and None mean ``default``).

        Raises ValueError naming the offered tiers for an unknown name. The server resolves a
        request's tier with it before sending, and the scheduler again on admission: one rule.
        """
        if name is None or name == AUTO_TIER:
            return DEFAULT_TIER
        names = [tier.name for tier in self.tiers]
        if name not in names:
            offered = ", ".join([AUTO_TIER, *names])
            raise ValueError(f"service_tier {name!r} is not offered by this server; choose one of {offered}")
        return name

    def cuts_steps(self) -> bool:
        """Whether some arrivals may cut a step in flight short (``step_control.py``)."""
        return bool(self.ttft_target_tiers()) or self.short_prefill_interrupt > 0

    def validate(self) -> None:
        """Raise ValueError naming the field for tier, fairness and admission settings that cannot work."""
        if self.short_prefill_interrupt < 0:
            raise ValueError(
                f"short_prefill_interrupt must be >= 0 tokens, got {self.short_prefill_interrupt}"
            )
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {list(ADMISSIONS)}, got {self.admission!r}")
        names = [tier.name for tier in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"service tier names must be unique, got {names}")
        if DEFAULT_TIER not in names:
            raise ValueError(f"the service tiers must include 'default' (what 'auto' means), got {names}")
        if AUTO_TIER in names:
            raise ValueError("'auto' is not a tier of its own: it means 'default'")
        for tier in self.tiers:
            if not 0.0 < tier.step_share <= 1.0:
                raise ValueError(f"tier {tier.name}: step_share must be in (0, 1], got {tier.step_share}")
            for name in ("max_running", "max_waiting"):
                value = getattr(tier, name)
                if value is not None and value < (1 if name == "max_running" else 0):
                    raise ValueError(f"tier {tier.name}: {name} must be positive, got {value}")
            for name in ("ttft_slo", "tpot_slo"):
                value = getattr(tier, name)
                if value is not None and value <= 0:
                    raise ValueError(f"tier {tier.name}: {name} must be > 0 seconds, got {value}")
        for user, weight in self.user_weights.items():
            if weight <= 0:
                raise ValueError(f"user weight for {user!r} must be > 0, got {weight}")
        if self.fair_input_weight < 0 or self.fair_output_weight < 0:
            raise ValueError("fair_input_weight and fair_output_weight must be >= 0")
        if not 0.0 < self.slo_guard_share <= 1.0:
            raise ValueError(f"slo_guard_share must be in (0, 1], got {self.slo_guard_share}")
        if not 0.0 < self.slo_margin <= 1.0:
            raise ValueError(f"slo_margin must be in (0, 1], got {self.slo_margin}")
        if not 0.0 < self.ttft_step_fraction <= 1.0:
            raise ValueError(f"ttft_step_fraction must be in (0, 1], got {self.ttft_step_fraction}")
        if self.max_exclusive_steps < 0:
            raise ValueError(f"max_exclusive_steps must be >= 0, got {self.max_exclusive_steps}")


# Speculative decoding methods (``SpeculativeConfig.method``): which run today, and which are named
# by the design but not built yet (asking for one is a start-up error saying so).
SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp", "eagle", "eagle3")
SPECULATIVE_METHODS_PLANNED: tuple[str, ...] = ()


@dataclass
class SpeculativeConfig:
    """Speculative decoding (``spec/``; off when ``EngineConfig.speculative_config`` is None).

    ``method``: ``ngram`` proposes the tokens that followed the latest earlier occurrence of the
    sequence's last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens (prompt lookup; no model).
    ``num_speculative_tokens``: the most draft tokens per request and step. ``draft_confidence``: the
    drafter stops at the first draft token whose own probability estimate is below it (0 turns the
    cut off). ``adaptive``: the scheduler drafts fewer tokens (or none) per request on a step where
    the step-time model says extra tokens cost more than their expected accepted share brings.
    ``model``: the draft model of ``draft_model`` (a bundled alias, folder or GGUF with the target's
    vocabulary; it drafts greedily with its own KV cache in the worker: ``worker/draft_model.py``).
    ``mtp`` drafts with the checkpoint's own multi-token-prediction layer (DeepSeek-V3, Kimi K2) from
    the target's hidden states (``worker/mtp_proposer.py``). ``eagle`` / ``eagle3`` draft with an
    EAGLE-1 / EAGLE-3 head whose folder is ``model`` (``worker/eagle_proposer.py``).
    ``quantization``: the drafter's weight-only quantization (``draft_model``, ``eagle``, ``eagle3``),
    as ``ModelConfig.quantization``: ``none`` (weights as loaded), ``int8`` or ``int4`` (CPU,
    bfloat16). Drafts only propose and verification keeps the target's tokens, so quantizing a
    drafter changes acceptance, never outputs. None (the default): an EAGLE head in bfloat16 on CPU
    takes ``int4`` where the int4 kernel loads (a draft step streams a quarter of the head's bytes),
    anything else its weights as loaded.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    draft_confidence: float = 0.5
    adaptive: bool = True
    model: str | None = None
    quantization: str | None = None

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        """``LLM(speculative_config={...})`` / ``--speculative-config '{json}'``; unknown keys raise."""
        unknown = sorted(set(values) - set(cls.__dataclass_fields__))
        if unknown:
            known = ", ".join(cls.__dataclass_fields__)
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r}; known keys: {known}")
        return cls(**values)

    def validate(self) -> None:
        if self.method in SPECULATIVE_METHODS_PLANNED:
            raise ValueError(
                f"speculative_config method {self.method!r} is not supported yet; supported: "
                f"{', '.join(SPECULATIVE_METHODS)}"
            )
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config method must be one of {SPECULATIVE_METHODS}, got {self.method!r}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative_config method "draft_model" needs "model": the draft model')
        if self.method in ("eagle", "eagle3") and not self.model:
            raise ValueError(f'speculative_config method "{self.method}" needs "model": the head\'s folder')
        if self.method not in ("draft_model", "eagle", "eagle3") and self.model is not None:
            raise ValueError(
                f'speculative_config "model" is only for methods "draft_model", "eagle" and "eagle3", '
                f"not {self.method!r}"
            )
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(
                f"num_speculative_tokens must be within 1..32, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if not 0.0 <= self.draft_confidence <= 1.0:
            raise ValueError(f"draft_confidence must be within [0, 1], got {self.draft_confidence}")
        if self.quantization is not None and self.method not in ("draft_model", "eagle", "eagle3"):
            raise ValueError(
                f'speculative_config "quantization" is for the drafter\'s weights (methods "draft_model", '
                f'"eagle" and "eagle3"); method {self.method!r} has none of its own'
            )


# How a data-parallel server picks the engine for a request (``router/policy.py``).
DP_POLICIES = ("cache_aware", "round_robin", "least_load")


@dataclass
class DataParallelConfig:
    """Data parallelism: ``data_parallel_size`` engine processes behind one server
    (``core/dp_client.py``), each with its own copy of the weights and its own KV cache (a
    ``kv_cache_memory`` fraction, and the default ``kv_cache_memory_fraction``, are shared out between
    them; bytes and ``num_blocks`` are per engine). ``dp_policy`` picks an engine per request
    (``cache_aware``: the longest prefix the engine is believed to cache, unless the in-flight loads
    differ by more than ``dp_balance_abs`` requests and by more than ``dp_balance_rel`` times: then
    the least loaded).
    """

    data_parallel_size: int = 1
    dp_policy: str = "cache_aware"
    dp_balance_abs: int = 8
    dp_balance_rel: float = 1.5
    # What runs the replicas: engine processes of this machine, or Ray actors (core/dp_ray.py).
    data_parallel_backend: str = "mp"
    # Set on a replica's own config: report the prefix cache's changes in the step outputs
    # (core/kv/kv_events.py), which feed the frontend's per-replica prefix index.
    publish_kv_events: bool = False

    def validate(self) -> None:
        if self.data_parallel_backend not in DATA_PARALLEL_BACKENDS:
            raise ValueError(
                f"data_parallel_backend must be one of {', '.join(DATA_PARALLEL_BACKENDS)}, "
                f"got {self.data_parallel_backend!r}"
            )
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.dp_policy not in DP_POLICIES:
            raise ValueError(f"dp_policy must be one of {', '.join(DP_POLICIES)}, got {self.dp_policy!r}")
        if self.dp_balance_abs < 0:
            raise ValueError(f"dp_balance_abs must be >= 0, got {self.dp_balance_abs}")
        if self.dp_balance_rel < 1.0:
            raise ValueError(f"dp_balance_rel must be >= 1.0, got {self.dp_balance_rel}")


@dataclass
class EngineConfig:
    """Everything the engine core needs at start-up.

    ``jump_forward``: when a request's grammar allows exactly one next token, append it without
    sampling (the output is the same; requests asking for logprobs always sample).
    ``engine_niceness``: how much the server's engine process lowers its own CPU priority (``nice``,
    0-19; the in-process ``LLM`` ignores it). On a CPU the engine's passes keep every core busy for
    tens of milliseconds, while the server's work (HTTP, tokenizing, streaming tokens) comes in short
    bursts that a request's latency waits on: at a lower priority the engine yields to those bursts
    at once rather than time-slicing with them (``tokenmill serve``'s default on CPUs is 5).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)
    num_threads: int | None = None
    jump_forward: bool = True
    engine_niceness: int = 0
    # What runs the model: "inprocess" (this process) or "mp" (one worker child process, plans sent
    # as deltas over ZMQ: executor/multiproc.py).
    executor_backend: str = "inprocess"
    # RL (docs/architecture.md "RL"): which distribution logprobs describe (LOGPROBS_MODES), and
    # logprobs equal to a float32 transformers recompute within 1e-4 (float32 weights, KV and
    # kernels; no quantization).
    logprobs_mode: str = "raw_logprobs"
    rl_exact_logprobs: bool = False
    # Batch-invariant outputs (layers/batch_invariant.py): a request's tokens and logprobs
    # do not depend on the other requests, the chunk size, prefix-cache hits or preemption.
    deterministic: bool = False
    # Speculative decoding (spec/), or None for none.
    speculative_config: SpeculativeConfig | None = None
    # Tensor parallelism (docs/scaling-tp.md): the model sharded over this many worker processes
    # (or Ray actors: distributed_executor_backend), each with ``threads_per_rank`` CPU threads
    # (default: the engine's threads split evenly).
    tensor_parallel_size: int = 1
    threads_per_rank: int | None = None
    distributed_executor_backend: str = "mp"
    # Mixture-of-experts layers split whole experts over the ranks (not each expert's features).
    enable_expert_parallel: bool = False

    def validate(self) -> None:
        if self.model.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.model.dtype!r}")
        if self.cache.kv_cache_dtype not in DTYPE_CHOICES:
            raise ValueError(
                f"kv_cache_dtype must be auto, float32, bfloat16 or float16, got {self.cache.kv_cache_dtype!r}"
            )
        if self.model.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {self.model.model_impl!r}")
        if self.cache.block_size < 1 or self.cache.block_size & (self.cache.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.cache.block_size}")
        if self.scheduler.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.scheduler.max_num_batched_tokens}"
            )
        if self.scheduler.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.scheduler.max_num_seqs}")
        if not 0 <= self.engine_niceness <= 19:
            raise ValueError(f"engine_niceness must be within 0..19, got {self.engine_niceness}")
        if self.executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"executor_backend must be one of {EXECUTOR_BACKENDS}, got {self.executor_backend!r}"
            )
        self.scheduler.validate()
        self._validate_tensor_parallel()
        self._validate_logprobs()
        self._validate_deterministic()
        self.lora.validate()
        self.data_parallel.validate()
        if self.speculative_config is not None:
            self.speculative_config.validate()
        mem = self.cache.kv_cache_memory
        if isinstance(mem, float) and not 0.0 < mem <= 1.0:
            raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1], got {mem}")
        if isinstance(mem, int) and mem < 1:
            raise ValueError(f"kv_cache_memory in bytes must be >= 1, got {mem}")
        if not 0.0 < self.cache.kv_cache_memory_fraction <= 1.0:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 1], got {self.cache.kv_cache_memory_fraction}"
            )
        if self.cache.num_blocks is not None and self.cache.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.cache.num_blocks}")
        interval = self.cache.state_checkpoint_interval
        if interval is not None and (interval < 1 or interval % self.cache.block_size):
            raise ValueError(
                f"state_checkpoint_interval must be a positive multiple of block_size "
                f"({self.cache.block_size}), got {interval}"
            )

    def _validate_tensor_parallel(self) -> None:
        """Sizes, and the features that do not compose with tensor parallelism yet, named."""
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.threads_per_rank is not None and self.threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be >= 1, got {self.threads_per_rank}")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {DISTRIBUTED_EXECUTOR_BACKENDS}, "
                f"got {self.distributed_executor_backend!r}"
            )
        if self.tensor_parallel_size == 1:
            return
        refused = {
            "speculative decoding": self.speculative_config is not None,
            "deterministic mode": self.deterministic,
            "the transformers model implementation": self.model.model_impl == "transformers",
        }
        for feature, on in refused.items():
            if on:
                raise ValueError(
                    f"tensor parallelism (tensor_parallel_size > 1) cannot be combined with {feature} yet"
                )

    def _validate_logprobs(self) -> None:
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if not self.rl_exact_logprobs:
            return
        for name, value in (("dtype", self.model.dtype), ("kv_cache_dtype", self.cache.kv_cache_dtype)):
            if value not in ("auto", "float32"):
                raise ValueError(f"rl_exact_logprobs computes in float32; it cannot run with {name}={value}")
        if self.model.quantization not in (None, "none"):
            raise ValueError(
                f"rl_exact_logprobs cannot run with quantization={self.model.quantization}: "
                "quantized weights change the logprobs"
            )

    def _validate_deterministic(self) -> None:
        """The deterministic mode holds where every kernel's reduction order is known not to depend
        on the batch: the native model code (layers/batch_invariant.py puts its layers on their
        batch-invariant paths, any dtype, quantized weights through their float copies). The
        transformers fallback and LoRA (its kernels group rows by adapter) are refused."""
        if not self.deterministic:
            return
        if self.model.model_impl == "transformers":
            raise ValueError("deterministic mode needs the native model implementation, not transformers")
        if self.lora.enable_lora:
            raise ValueError("deterministic mode cannot be combined with LoRA yet")


def build_engine_config(model: str, **kwargs: Any) -> EngineConfig:
    """Sort keyword arguments into the engine's config sections; unknown names raise ValueError."""
    sections: dict[str, Any] = {
        "model": ModelConfig,
        "cache": CacheConfig,
        "scheduler": SchedulerConfig,
        "lora": LoRAConfig,
        "data_parallel": DataParallelConfig,
    }
    values: dict[str, dict[str, Any]] = {name: {} for name in sections}
    engine_kwargs: dict[str, Any] = {}
    for key, value in kwargs.items():
        for section, cls in sections.items():
            if key in cls.__dataclass_fields__:
                values[section][key] = value
                break
        else:
            if key == "speculative_config" and isinstance(value, dict):
                engine_kwargs[key] = SpeculativeConfig.from_dict(value)
            elif key in EngineConfig.__dataclass_fields__ and key not in sections:
                engine_kwargs[key] = value
            else:
                raise ValueError(f"unknown engine argument {key!r}")
    return EngineConfig(
        model=ModelConfig(model=model, **values["model"]),
        cache=CacheConfig(**values["cache"]),
        scheduler=SchedulerConfig(**values["scheduler"]),
        lora=LoRAConfig(**values["lora"]),
        data_parallel=DataParallelConfig(**values["data_parallel"]),
        **engine_kwargs,
    )
