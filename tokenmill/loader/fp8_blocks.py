"""FP8 block-quantized checkpoints (DeepSeek-V3/R1, Kimi K2): dequantized while the weights stream in.

Such a checkpoint stores a quantized linear weight as ``float8_e4m3fn`` ``[out, in]`` beside
``<name>_scale_inv`` (float32 ``[ceil(out / bo), ceil(in / bi)]``, one scale per ``bo x bi`` block,
``quantization_config.weight_block_size``; 128 x 128 in DeepSeek's releases); the real weight is the
fp8 value times its block's scale. tokenmill computes in bfloat16 or float32 on CPU, so each weight is
dequantized as it is read and the scales disappear from the stream: the model loads the plain
weights it would load from a bf16 checkpoint. The weights then take 2 (bfloat16) or 4 (float32)
bytes per fp8 byte; ``describe_fp8_checkpoint`` says how much before loading starts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from safetensors import safe_open

logger = logging.getLogger(__name__)

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_block_size(config: Any) -> tuple[int, int] | None:
    """``weight_block_size`` of a config whose ``quantization_config`` is block-wise fp8, else None.
    Another fp8 scheme (per-tensor, per-channel) raises ValueError naming it."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    settings = quantization if isinstance(quantization, dict) else vars(quantization)
    if settings.get("quant_method") != "fp8":
        return None
    block = settings.get("weight_block_size")
    if not block or len(block) != 2:
        raise ValueError(
            f"fp8 checkpoints without weight_block_size (per-tensor or per-channel scales) are not "
            f"supported; quantization_config is {settings}"
        )
    return int(block[0]), int(block[1])


def dequantize_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``weight`` ``[out, in]`` fp8 times its per-block ``scale_inv`` ``[ceil(out/bo), ceil(in/bi)]``,
    as float32 ``[out, in]`` (edge blocks may be partial)."""
    out_features, in_features = weight.shape
    rows, cols = -(-out_features // block[0]), -(-in_features // block[1])
    if tuple(scale_inv.shape) != (rows, cols):
        raise ValueError(
            f"fp8 weight {tuple(weight.shape)} with {block[0]}x{block[1]} blocks needs scales of shape "
            f"{(rows, cols)}, got {tuple(scale_inv.shape)}"
        )
    scales = scale_inv.float().repeat_interleave(block[0], 0)[:out_features]  # [out, cols]
    scales = scales.repeat_interleave(block[1], 1)[:, :in_features]  # [out, in]
    return weight.float() * scales


def dequantize_stream(
    weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with every fp8 ``<name>`` and its ``<name>_scale_inv`` replaced by the float32
    dequantized ``<name>``; other tensors pass through. A weight waits for its scale (and a scale for
    its weight) when the checkpoint stores them apart; one left unpaired at the end raises ValueError."""
    weights_waiting: dict[str, torch.Tensor] = {}
    scales_waiting: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(SCALE_SUFFIX):
            target = name.removesuffix(SCALE_SUFFIX)
            weight = weights_waiting.pop(target, None)
            if weight is None:
                scales_waiting[target] = tensor
            else:
                yield target, dequantize_block(weight, tensor, block)
        elif tensor.dtype in FP8_DTYPES:
            scale = scales_waiting.pop(name, None)
            if scale is None:
                weights_waiting[name] = tensor
            else:
                yield name, dequantize_block(tensor, scale, block)
        else:
            yield name, tensor
    if weights_waiting or scales_waiting:
        unpaired = sorted(weights_waiting) + [n + SCALE_SUFFIX for n in sorted(scales_waiting)]
        raise ValueError(f"fp8 checkpoint tensors without their weight or scale: {unpaired[:5]}")


def describe_fp8_checkpoint(files: list[str]) -> tuple[int, int, int]:
    """From the safetensors headers only: ``(fp8 weights, their elements, scale tensors)``."""
    num_fp8 = elements = num_scales = 0
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if name.endswith(SCALE_SUFFIX):
                    num_scales += 1
                    continue
                view = f.get_slice(name)
                if view.get_dtype() in ("F8_E4M3", "F8_E5M2"):
                    num_fp8 += 1
                    count = 1
                    for size in view.get_shape():
                        count *= size
                    elements += count
    return num_fp8, elements, num_scales


def log_memory_needed(files: list[str], block: tuple[int, int]) -> None:
    """Log (a warning: it can be a lot) the memory the dequantized fp8 weights of ``files`` need."""
    num_fp8, elements, _ = describe_fp8_checkpoint(files)
    logger.warning(
        "fp8 block-quantized checkpoint (%dx%d blocks): dequantizing %d fp8 weights (%.2f GB on disk) on "
        "load; they need %.2f GB in bfloat16 or %.2f GB in float32, plus the unquantized tensors",
        block[0],
        block[1],
        num_fp8,
        elements / 1e9,
        2 * elements / 1e9,
        4 * elements / 1e9,
    )
