"""Engine, cache and scheduler configuration. All environment-variable reads live here; no torch.

Every field has a default that works on a small CPU machine; ``EngineConfig.validate`` raises
``ValueError`` naming the field for values that cannot work.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any


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


def attention_backend_choice() -> str:
    """``TOKENMILL_ATTENTION_BACKEND``: ``auto`` (the default) lets each device pick its fastest
    attention backend; ``torch`` forces the reference backend, ``cpu`` the C++ CPU kernel."""
    value = os.environ.get("TOKENMILL_ATTENTION_BACKEND") or "auto"
    if value not in ATTENTION_BACKENDS:
        raise ValueError(f"TOKENMILL_ATTENTION_BACKEND must be one of {ATTENTION_BACKENDS}, got {value!r}")
    return value


def extension_cache_dir() -> str:
    """Where compiled C++ kernels are cached: ``$TOKENMILL_CACHE_DIR/extensions``, by default
    ``$XDG_CACHE_HOME/tokenmill/extensions`` (``~/.cache/tokenmill/extensions``)."""
    root = os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "tokenmill"
    )
    return os.path.join(root, "extensions")


@dataclass
class ModelConfig:
    """Which model to run and in what precision.

    ``model`` is a bundled alias (``smollm2-135m``), a Hugging Face folder or a ``.gguf`` file.
    ``dtype`` is ``auto`` (bfloat16 where the CPU or GPU supports it well, else float32),
    ``float32`` or ``bfloat16``. ``max_model_len`` caps prompt + output tokens per sequence; None
    takes the model's own limit.
    """

    model: str = "smollm2-135m"
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    device: str = "cpu"
    served_model_name: str | None = None


@dataclass
class CacheConfig:
    """KV cache sizing.

    ``kv_cache_memory`` is a byte budget (an int) or, when a float in (0, 1], the fraction of the
    machine's available memory to give to KV blocks. ``num_blocks`` overrides both (tests use it).
    """

    block_size: int = 16
    kv_cache_memory: int | float = 0.25
    num_blocks: int | None = None
    enable_prefix_caching: bool = True


@dataclass
class SchedulerConfig:
    """Batching limits and the waiting-queue policy.

    ``max_num_batched_tokens`` is the per-step token budget (chunked prefill splits prompts to fit);
    ``max_num_seqs`` caps running sequences; ``policy`` names the waiting-queue order.
    ``max_waiting`` bounds the waiting queue (None: unbounded) so servers can answer 429.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    policy: str = "fcfs"
    max_waiting: int | None = None


@dataclass
class EngineConfig:
    """Everything the engine core needs at start-up.

    ``jump_forward``: when a request's grammar allows exactly one next token, append it without
    sampling (the output is the same; requests asking for logprobs always sample).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_threads: int | None = None
    jump_forward: bool = True

    def validate(self) -> None:
        if self.model.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.model.dtype!r}")
        if self.cache.block_size < 1 or self.cache.block_size & (self.cache.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.cache.block_size}")
        if self.scheduler.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.scheduler.max_num_batched_tokens}"
            )
        if self.scheduler.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.scheduler.max_num_seqs}")
        mem = self.cache.kv_cache_memory
        if isinstance(mem, float) and not 0.0 < mem <= 1.0:
            raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1], got {mem}")
        if isinstance(mem, int) and mem < 1:
            raise ValueError(f"kv_cache_memory in bytes must be >= 1, got {mem}")
        if self.cache.num_blocks is not None and self.cache.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.cache.num_blocks}")


def build_engine_config(model: str, **kwargs: Any) -> EngineConfig:
    """Sort keyword arguments into the engine's config sections; unknown names raise ValueError."""
    sections: dict[str, Any] = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}
    values: dict[str, dict[str, Any]] = {name: {} for name in sections}
    engine_kwargs: dict[str, Any] = {}
    for key, value in kwargs.items():
        for section, cls in sections.items():
            if key in cls.__dataclass_fields__:
                values[section][key] = value
                break
        else:
            if key in EngineConfig.__dataclass_fields__ and key not in sections:
                engine_kwargs[key] = value
            else:
                raise ValueError(f"unknown engine argument {key!r}")
    return EngineConfig(
        model=ModelConfig(model=model, **values["model"]),
        cache=CacheConfig(**values["cache"]),
        scheduler=SchedulerConfig(**values["scheduler"]),
        **engine_kwargs,
    )
