"""GGUF models converted once to Hugging Face folders, so that only the first start pays for it.

Reading a GGUF costs seconds before the first token: transformers parses the whole tokenizer out of
the file's metadata in Python, and every quantized tensor is dequantized with numpy. The first time a
GGUF file is resolved, its config, tokenizer (with its chat template) and dequantized weights
(safetensors, in the dtype the GGUF reader yields, so values are unchanged) are written to
``model-v<FORMAT_VERSION>`` inside the file's cache entry (``gguf_loader.converted_metadata_folder``:
keyed by path, size, modification time and transformers version); later starts load that folder
(safetensors are memory-mapped). It is written with ``gguf_loader.save_atomically``, so a crashed
conversion never leaves a half folder that looks complete.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator

import torch
from safetensors.torch import save_file

from tokenmill.loader.gguf_loader import converted_metadata_folder, save_atomically

logger = logging.getLogger(__name__)

# Bump when what is written (or how the GGUF reader maps tensors) changes.
FORMAT_VERSION = 1
# Bytes per safetensors shard: keeps the peak memory of a conversion to one shard's worth.
_SHARD_BYTES = 1 << 30


def converted_folder(gguf_path: str) -> str:
    """Where the converted Hugging Face folder of ``gguf_path`` (in its current state) lives."""
    return os.path.join(converted_metadata_folder(gguf_path), f"model-v{FORMAT_VERSION}")


def cached_folder(gguf_path: str) -> str | None:
    """The converted folder of ``gguf_path`` when a complete one exists, else None."""
    folder = converted_folder(gguf_path)
    return folder if os.path.isfile(os.path.join(folder, "config.json")) else None


def convert(
    gguf_path: str,
    config: object,
    tokenizer: object,
    weights: Iterator[tuple[str, torch.Tensor]],
) -> str | None:
    """Write the converted folder of ``gguf_path`` and return its path; None when the cache cannot be
    written (the caller then reads the GGUF directly).

    ``config`` and ``tokenizer`` are the transformers objects read from the GGUF (saved with
    ``save_pretrained``); ``weights`` yields ``(hf_name, tensor)``.
    """
    start = time.perf_counter()
    final = converted_folder(gguf_path)

    def write(staging: str) -> None:
        tokenizer.save_pretrained(staging)  # type: ignore[attr-defined]
        weight_map: dict[str, str] = {}
        shard: dict[str, torch.Tensor] = {}
        shard_bytes = 0
        for name, tensor in weights:
            shard[name] = tensor.contiguous()
            shard_bytes += tensor.numel() * tensor.element_size()
            if shard_bytes >= _SHARD_BYTES:
                _write_shard(staging, shard, weight_map)
                shard, shard_bytes = {}, 0
        if shard:
            _write_shard(staging, shard, weight_map)
        index = {"metadata": {}, "weight_map": weight_map}
        with open(os.path.join(staging, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f)
        config.save_pretrained(staging)  # type: ignore[attr-defined]

    if not save_atomically(final, write):
        # A concurrent conversion of the same file may have won the rename: its folder is as good.
        return cached_folder(gguf_path)
    logger.info(
        "converted %s to %s in %.1f s (later starts load it)", gguf_path, final, time.perf_counter() - start
    )
    return final


def _write_shard(folder: str, tensors: dict[str, torch.Tensor], weight_map: dict[str, str]) -> None:
    name = f"model-{len(set(weight_map.values())):05d}.safetensors"
    save_file(tensors, os.path.join(folder, name), metadata={"format": "pt"})
    weight_map.update({tensor_name: name for tensor_name in tensors})
