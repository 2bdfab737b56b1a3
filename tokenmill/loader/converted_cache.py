"""A cache of GGUF models converted to Hugging Face folders, so that only the first start pays for it.

Reading a GGUF costs seconds before the first token: transformers parses the whole tokenizer out of
the file's metadata in Python (config and tokenizer each), and every quantized tensor is dequantized
with numpy. The first time a GGUF file is resolved, its config, tokenizer (with its chat template)
and dequantized weights (safetensors, in the dtype the GGUF reader yields, so values are unchanged)
are written to ``converted_cache_dir()/<key>``; later starts load that folder (safetensors are
memory-mapped). The key hashes the file's absolute path, size and modification time plus a format
version, so a changed file gets a new conversion. The folder appears atomically (written under a
temporary name, then renamed): a crashed conversion never leaves a half folder that looks complete.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from tokenmill.config import converted_cache_dir

logger = logging.getLogger(__name__)

# Bump when what is written (or how the GGUF reader maps tensors) changes.
FORMAT_VERSION = 1
# Tensors per safetensors shard: keeps the peak memory of a conversion to one shard's worth.
_SHARD_BYTES = 1 << 30


def cache_key(gguf_path: str) -> str:
    """The cache folder name for this GGUF file in its current state."""
    stat = os.stat(gguf_path)
    digest = hashlib.sha256(
        f"{os.path.abspath(gguf_path)}|{stat.st_size}|{stat.st_mtime_ns}|{FORMAT_VERSION}".encode()
    )
    return f"{Path(gguf_path).stem}-{digest.hexdigest()[:16]}"


def cached_folder(gguf_path: str) -> str | None:
    """The converted folder of ``gguf_path`` when a complete one exists, else None."""
    folder = Path(converted_cache_dir()) / cache_key(gguf_path)
    return str(folder) if (folder / "config.json").is_file() else None


def convert(
    gguf_path: str,
    config: object,
    tokenizer: object,
    weights: Iterator[tuple[str, torch.Tensor]],
) -> str:
    """Write the converted folder for ``gguf_path`` and return its path.

    ``config`` and ``tokenizer`` are the transformers objects read from the GGUF (saved with
    ``save_pretrained``); ``weights`` yields ``(hf_name, tensor)``. Raises OSError when the cache
    directory cannot be written (the caller then keeps loading the GGUF directly).
    """
    start = time.perf_counter()
    root = Path(converted_cache_dir())
    root.mkdir(parents=True, exist_ok=True)
    final = root / cache_key(gguf_path)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=root))
    try:
        tokenizer.save_pretrained(staging)  # type: ignore[attr-defined]
        shard: dict[str, torch.Tensor] = {}
        shard_bytes, index = 0, 0
        weight_map: dict[str, str] = {}
        for name, tensor in weights:
            shard[name] = tensor.contiguous()
            shard_bytes += tensor.numel() * tensor.element_size()
            if shard_bytes >= _SHARD_BYTES:
                index = _write_shard(staging, index, shard, weight_map)
                shard, shard_bytes = {}, 0
        if shard:
            _write_shard(staging, index, shard, weight_map)
        _write_index(staging, weight_map)
        # config.json last: its presence is what marks a folder complete.
        config.save_pretrained(staging)  # type: ignore[attr-defined]
        try:
            staging.rename(final)
        except OSError:
            if not (final / "config.json").is_file():  # not a concurrent conversion that won the race
                raise
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info(
        "converted %s to %s in %.1f s (later starts load it)", gguf_path, final, time.perf_counter() - start
    )
    return str(final)


def _write_shard(
    folder: Path, index: int, tensors: dict[str, torch.Tensor], weight_map: dict[str, str]
) -> int:
    name = f"model-{index:05d}.safetensors"
    save_file(tensors, str(folder / name), metadata={"format": "pt"})
    weight_map.update({tensor_name: name for tensor_name in tensors})
    return index + 1


def _write_index(folder: Path, weight_map: dict[str, str]) -> None:
    import json

    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
