"""The model runner's model loading: the implementation (native or the transformers fallback),
the module built on ``device`` in ``dtype`` (a tensor-parallel shard where the class takes one) and
its weights read from ``source``. What the layers derive from their weights (quantized copies,
packed matrices) stays with the runner (``ModelRunner._derive_weights``), which redoes it after
weight updates.
"""

from __future__ import annotations

import torch

from tokenmill.config import EngineConfig
from tokenmill.layers.tensor_parallel import TensorParallel
from tokenmill.loader import ModelSource
from tokenmill.loader.progress import iter_with_progress
from tokenmill.models.base import CausalLM
from tokenmill.models.registry import choose_model_impl, resolve_model_class, takes_tensor_parallel


def load_model(
    config: EngineConfig, source: ModelSource, tp: TensorParallel, dtype: torch.dtype, device: torch.device
) -> tuple[CausalLM, str, str]:
    """``(model, model_impl, description)``: the loaded model in eval mode, ``"native"`` or
    ``"transformers"``, and the start of its log description. ValueError for what the chosen
    implementation cannot run (tensor parallelism, quantization under the fallback)."""
    model_impl = choose_model_impl(source.hf_config, config.model.model_impl)
    model: CausalLM
    if model_impl == "transformers" and tp.size > 1:
        raise ValueError(
            "tensor parallelism needs a native model implementation; the transformers fallback "
            f"runs {source.hf_config.architectures} unsharded (use tensor_parallel_size=1)"
        )
    if model_impl == "transformers":
        # Imported here: transformers' modelling machinery takes seconds to import.
        from tokenmill.models.transformers_fallback import load_transformers_model

        model = load_transformers_model(source.path, source.format, source.hf_config, dtype, device)
        if config.model.quantization is not None:
            raise ValueError(
                f"quantization {config.model.quantization!r} is not supported with the transformers "
                "implementation; use model_impl='native' or no quantization"
            )
        return model, model_impl, f"transformers {type(model.hf_model).__name__} over paged attention"
    model_class = resolve_model_class(source.hf_config)
    sharded = takes_tensor_parallel(model_class)
    if tp.size > 1 and not sharded:
        raise ValueError(
            f"tensor parallelism is not supported for {model_class.__name__} yet; run it with tensor_parallel_size=1"
        )
    with torch.device(device):
        shard = {"tp": tp} if sharded else {}
        model = model_class(source.hf_config, dtype, **shard)  # type: ignore[call-arg]
    model.to(dtype)  # norms are built in float32; rotary tables stay float32
    model.load_weights(iter_with_progress(source))  # type: ignore[operator]
    model.eval()
    description = f"native {model_class.__name__}" + (
        f", tensor-parallel rank {tp.rank} of {tp.size}" if tp.size > 1 else ""
    )
    return model, model_impl, description
