"""Hugging Face model folders: ``config.json``, tokenizer files and safetensors (or ``.bin``) weights.

Everything is read from the local folder (``local_files_only``): tokenmill never downloads from a hub.
Weights come from safetensors when the folder has any; a folder with only ``pytorch_model*.bin`` is read
with ``torch.load(weights_only=True)``, which refuses arbitrary pickled objects.
"""

from __future__ import annotations

import glob
import json
import os
import zipfile
from collections.abc import Callable, Iterator

import torch
import transformers
from safetensors import safe_open

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"


def is_hf_folder(folder: str) -> bool:
    """True when ``folder`` looks like a Hugging Face model folder (it has a ``config.json``)."""
    return os.path.isfile(os.path.join(folder, "config.json"))


# Model types whose config.json names remote code that transformers does not ship, mapped to the
# built-in config class of the same architecture (Kimi K2 is DeepSeek-V3's architecture).
CONFIG_ALIASES = {"kimi_k2": "deepseek_v3"}


def load_config(folder: str) -> transformers.PretrainedConfig:
    """The model's config from ``config.json``; remote code is never trusted here. A model type in
    ``CONFIG_ALIASES`` is read with its architecture's built-in config class."""
    with open(os.path.join(folder, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    if model_type in CONFIG_ALIASES:
        config_class = transformers.CONFIG_MAPPING[CONFIG_ALIASES[model_type]]
        return config_class.from_pretrained(folder, local_files_only=True)
    return transformers.AutoConfig.from_pretrained(folder, trust_remote_code=False, local_files_only=True)


def load_tokenizer(folder: str) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer saved in ``folder``, with its chat template when ``tokenizer_config.json`` has one."""
    return transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=False, local_files_only=True)


def _shards_from_index(index_path: str) -> list[str]:
    folder = os.path.dirname(index_path)
    with open(index_path) as f:
        weight_map: dict[str, str] = json.load(f)["weight_map"]
    return [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]


def weight_files(folder: str) -> tuple[str, list[str]]:
    """Return ``(kind, files)`` where kind is ``"safetensors"`` or ``"bin"``.

    An index file decides which shards belong to the model; without one, ``model.safetensors`` alone is
    used when present (folders sometimes also carry a duplicate ``consolidated.safetensors``), else
    every ``*.safetensors``. Raises ``ValueError`` when the folder has no weights.
    """
    if os.path.isfile(os.path.join(folder, SAFETENSORS_INDEX)):
        return "safetensors", _shards_from_index(os.path.join(folder, SAFETENSORS_INDEX))
    if os.path.isfile(os.path.join(folder, SAFETENSORS_SINGLE)):
        return "safetensors", [os.path.join(folder, SAFETENSORS_SINGLE)]
    shards = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if shards:
        return "safetensors", shards
    if os.path.isfile(os.path.join(folder, BIN_INDEX)):
        return "bin", _shards_from_index(os.path.join(folder, BIN_INDEX))
    if os.path.isfile(os.path.join(folder, BIN_SINGLE)):
        return "bin", [os.path.join(folder, BIN_SINGLE)]
    raise ValueError(f"no weights in {folder!r}: expected *.safetensors or {BIN_SINGLE}")


def _load_bin(path: str) -> dict[str, torch.Tensor]:
    # weights_only refuses anything but tensors and plain containers, so a hostile file cannot run
    # code. Zip-format files (every torch.save since 1.6) can be memory-mapped, which keeps a large
    # shard from being read whole just to count or stream its tensors.
    state = torch.load(path, weights_only=True, map_location="cpu", mmap=zipfile.is_zipfile(path))
    if not isinstance(state, dict):
        raise ValueError(f"{path!r} does not hold a state dict")
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{path!r}: entry {name!r} is a {type(value).__name__}, not a tensor")
    return state


def iter_weights(
    folder: str, only: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor in the folder's weight files, one shard open at a time;
    with ``only``, just the tensors whose names it accepts (the others are not read from safetensors).

    Names are exactly as stored (Hugging Face parameter names); a tied ``lm_head.weight`` that the
    checkpoint leaves out is not invented here.
    """
    kind, files = weight_files(folder)
    for path in files:
        if kind == "safetensors":
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    if only is None or only(name):
                        yield name, f.get_tensor(name)
        else:
            state = _load_bin(path)
            yield from ((n, t) for n, t in state.items() if only is None or only(n))
            del state


def num_weight_tensors(folder: str) -> int:
    """How many tensors ``iter_weights`` yields; reads only safetensors headers."""
    kind, files = weight_files(folder)
    if kind == "safetensors":
        total = 0
        for path in files:
            with safe_open(path, framework="pt") as f:
                total += len(f.keys())
        return total
    return sum(len(_load_bin(path)) for path in files)
