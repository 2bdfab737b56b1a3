"""Maps Hugging Face architecture names to native model classes."""

from __future__ import annotations

import inspect

from tokenmill.models.base import CausalLM
from tokenmill.models.deepseek_v3 import DeepseekV3ForCausalLM
from tokenmill.models.gemma3 import Gemma3ForCausalLM
from tokenmill.models.gpt_oss import GptOssForCausalLM
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.mixtral import MixtralForCausalLM
from tokenmill.models.nemotron_h import NemotronHForCausalLM
from tokenmill.models.qwen3_next import Qwen3NextForCausalLM
from tokenmill.models.qwen_moe import QwenMoeForCausalLM

NATIVE_MODELS: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": QwenMoeForCausalLM,
    "Qwen3MoeForCausalLM": QwenMoeForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3NextForCausalLM,
    "NemotronHForCausalLM": NemotronHForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    # DeepSeek-V3/R1 and Kimi K2 (model_type kimi_k2, same architecture name).
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}
# Architectures with no native implementation yet, and why (named in the error).
NOT_NATIVE_YET: dict[str, str] = {
    "DeepseekV32ForCausalLM": "DeepSeek-V3.2's sparse attention (its lightning indexer) is not implemented natively",
}


def choose_model_impl(config, model_impl: str) -> str:  # type: ignore[no-untyped-def]
    """``"native"`` or ``"transformers"`` for ``model_impl`` (``auto``, ``native``, ``transformers``).

    ``auto`` is native when this registry has the architecture, else transformers; ``native`` for an
    architecture it lacks raises the ValueError of ``resolve_model_class``, which names it.
    """
    if model_impl == "transformers":
        return "transformers"
    try:
        resolve_model_class(config)
    except ValueError:
        if model_impl == "native":
            raise
        return "transformers"
    return "native"


def resolve_model_class(config) -> type[CausalLM]:  # type: ignore[no-untyped-def]
    """The native class for ``config.architectures``; ValueError names the architecture if none."""
    architectures = list(getattr(config, "architectures", None) or [])
    if not architectures and getattr(config, "model_type", None) in (
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "phi3",
    ):
        return LlamaForCausalLM  # GGUF-derived configs carry a model_type but no architectures
    if not architectures and getattr(config, "model_type", None) == "gemma3_text":
        return Gemma3ForCausalLM
    for arch in architectures:
        if arch in NATIVE_MODELS:
            return NATIVE_MODELS[arch]
        if arch in NOT_NATIVE_YET:
            raise ValueError(f"{arch}: {NOT_NATIVE_YET[arch]}; run it with --model-impl transformers")
    raise ValueError(
        f"no native implementation for architecture(s) {architectures or [config.model_type]}; "
        f"supported: {sorted(NATIVE_MODELS)}"
    )


def takes_tensor_parallel(model_class: type[CausalLM]) -> bool:
    """Whether the native class shards itself across tensor-parallel ranks (its constructor takes
    ``tp``); the others run with ``tensor_parallel_size=1`` only."""
    return "tp" in inspect.signature(model_class).parameters
