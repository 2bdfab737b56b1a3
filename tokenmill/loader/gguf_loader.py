"""GGUF files: config and tokenizer through transformers, weights dequantized by the ``gguf`` package.

Weights come out under Hugging Face parameter names and in Hugging Face layout, so a model built for a
safetensors checkpoint loads a GGUF file unchanged. Two things llama.cpp's converter did to the
tensors are undone here:

- For the ``llama`` architecture (which also covers Mistral GGUFs) it reordered the rows of each
  attention head of Q and K so that the two halves rotated together by rotary embedding sit next to
  each other (ggml rotates adjacent pairs; Hugging Face rotates dimension ``i`` with ``i + d/2``).
- For Gemma it stored RMSNorm weights as ``1 + w`` (ggml multiplies by the weight; Gemma's norm
  multiplies by ``1 + w``).

Qwen2/Qwen3 files are stored in Hugging Face order and need neither. gpt-oss and DeepSeek-V3 / Kimi K2
(``deepseek2``) files have their own config and tensor mapping (``gguf_moe.py``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from tokenmill.config import model_cache_dir
from tokenmill.loader import gguf_moe
from tokenmill.loader.gguf_index import GGUFIndex, IndexedTensor

logger = logging.getLogger(__name__)

# GGUF tensor names outside the transformer blocks.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# GGUF names inside block N (``blk.N.<name>``) → the Hugging Face module under ``model.layers.N``.
_LLAMA_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3, Gemma3
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Gemma3 has four norms per block; llama.cpp's "ffn_norm" is the one before the MLP there.
_GEMMA3_BLOCK_NAMES = {
    **_LLAMA_BLOCK_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

# Tensors with no Hugging Face parameter: llama3's rope frequency factors are recomputed from the
# config's rope scaling.
_SKIPPED = {"rope_freqs.weight"}

_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class _ArchRules:
    """How one GGUF architecture's tensors map back to Hugging Face."""

    block_names: dict[str, str]
    undo_rope_permute: bool = False  # llama.cpp reordered Q/K rows (see module docstring)
    norm_shift: float = 0.0  # llama.cpp stored norm weights as w + norm_shift


_ARCHITECTURES: dict[str, _ArchRules] = {
    "llama": _ArchRules(_LLAMA_BLOCK_NAMES, undo_rope_permute=True),
    "qwen2": _ArchRules(_LLAMA_BLOCK_NAMES),
    "qwen3": _ArchRules(_LLAMA_BLOCK_NAMES),
    "gemma3": _ArchRules(_GEMMA3_BLOCK_NAMES, norm_shift=1.0),
}


@functools.lru_cache(maxsize=1)
def _open_reader(path: str, mtime_ns: int) -> GGUFIndex:
    # Resolving, counting and loading all need the header; mtime_ns is part of the key so a replaced
    # file is read afresh.
    return GGUFIndex(path)


def open_reader(path: str) -> GGUFIndex:
    """A memory-mapped index of ``path`` (scalar metadata and tensors); the most recent one is cached."""
    path = os.path.abspath(path)
    return _open_reader(path, os.stat(path).st_mtime_ns)


def _field(reader: GGUFIndex, key: str) -> object | None:
    return reader.fields.get(key)


def architecture(path: str) -> str:
    """The file's ``general.architecture`` (llama.cpp's name, e.g. ``"llama"``, ``"qwen3"``)."""
    arch = _field(open_reader(path), "general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{path!r} has no general.architecture; is it a GGUF model file?")
    return arch


def _rules(path: str) -> _ArchRules:
    arch = architecture(path)
    rules = _ARCHITECTURES.get(arch)
    if rules is None:
        raise ValueError(
            f"GGUF architecture {arch!r} of {path!r} is not supported by the GGUF weight loader "
            f"(supported: {', '.join(sorted(_ARCHITECTURES))}); use a Hugging Face folder instead"
        )
    return rules


def check_supported(path: str) -> None:
    """Raise ``ValueError`` unless this loader can map every weight of the file's architecture."""
    if architecture(path) not in gguf_moe.ARCHITECTURES:  # those map their own (loader/gguf_moe.py)
        _rules(path)


def converted_metadata_folder(path: str) -> str:
    """Where what is converted from the GGUF file ``path`` is cached: its config and tokenizer here,
    and the whole model as a Hugging Face folder (``loader/converted_cache.py``).

    transformers converts GGUF metadata slowly (over a minute for Gemma 3's 262k-token vocabulary),
    so the result is saved once as Hugging Face files under ``model_cache_dir()/gguf-metadata``,
    keyed by the file's path, size and modification time and the transformers version.
    """
    path = os.path.abspath(path)
    stat = os.stat(path)
    identity = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return os.path.join(model_cache_dir(), "gguf-metadata", f"{os.path.basename(path)}-{key}")


def save_atomically(folder: str, write: Callable[[str], None]) -> bool:
    """Create ``folder`` by ``write(staging_folder)`` then one rename, so that a crash never leaves a
    half-written folder that looks complete. Returns False (and logs why) when the cache cannot be
    written (read-only, full, a concurrent writer won the rename): a failure only costs speed.
    Exceptions other than OSError propagate; the staging folder is removed either way.
    """
    staging = None
    try:
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        staging = tempfile.mkdtemp(dir=os.path.dirname(folder), prefix=".staging-")
        write(staging)
        os.replace(staging, folder)
        staging = None
        return True
    except OSError as exc:
        logger.info("not caching converted GGUF data in %s: %s", folder, exc)
        return False
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def _save_converted(saveable: Any, folder: str) -> None:
    """Save a converted config or tokenizer into ``folder`` (see ``save_atomically``)."""
    save_atomically(folder, saveable.save_pretrained)


def load_config(path: str) -> transformers.PretrainedConfig:
    """Build the Hugging Face config from the file's metadata (transformers' GGUF config reader).

    Where the file states the attention head size (``<arch>.attention.key_length``), it wins over the
    config class default: transformers does not read it for every architecture (e.g. qwen3). Cached
    (see ``converted_metadata_folder``).
    """
    cached = os.path.join(converted_metadata_folder(path), "config")
    if os.path.isfile(os.path.join(cached, "config.json")):
        return transformers.AutoConfig.from_pretrained(cached, local_files_only=True)
    if architecture(path) in gguf_moe.ARCHITECTURES:  # our own mapping of the metadata
        config = gguf_moe.build_config(open_reader(path), architecture(path))
        _save_converted(config, cached)
        return config
    folder, filename = os.path.split(os.path.abspath(path))
    config = transformers.AutoConfig.from_pretrained(folder, gguf_file=filename, local_files_only=True)
    key_length = _field(open_reader(path), f"{architecture(path)}.attention.key_length")
    if isinstance(key_length, int) and getattr(config, "head_dim", key_length) != key_length:
        config.head_dim = key_length
    _save_converted(config, cached)
    return config


def load_tokenizer(path: str) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer stored in the file; its ``chat_template`` comes from ``tokenizer.chat_template``.

    Cached (see ``converted_metadata_folder``).
    """
    cached = os.path.join(converted_metadata_folder(path), "tokenizer")
    if os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
        return transformers.AutoTokenizer.from_pretrained(cached, local_files_only=True)
    folder, filename = os.path.split(os.path.abspath(path))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=filename, local_files_only=True)
    _save_converted(tokenizer, cached)
    return tokenizer


def hf_name(gguf_name: str, rules: _ArchRules) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor, or None for tensors with no parameter.

    Raises ``ValueError`` for a name we do not know, rather than dropping a weight silently.
    """
    if gguf_name in _SKIPPED:
        return None
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    m = _BLOCK_TENSOR.fullmatch(gguf_name)
    if m is not None and m.group(2) in rules.block_names:
        return f"model.layers.{m.group(1)}.{rules.block_names[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known Hugging Face name")


def _to_torch(tensor: IndexedTensor) -> torch.Tensor:
    """Dequantize one tensor into a new (writable, file-independent) torch tensor in PyTorch shape.

    F32/F16/BF16 keep their dtype; every quantized type becomes float32.
    """
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions innermost first
    qtype = tensor.tensor_type
    if qtype == GGMLQuantizationType.F32:
        out = torch.from_numpy(np.array(tensor.data, dtype=np.float32))
    elif qtype == GGMLQuantizationType.F16:
        out = torch.from_numpy(np.array(tensor.data, dtype=np.float16))
    elif qtype == GGMLQuantizationType.BF16:
        # numpy has no bfloat16: reinterpret the raw 16-bit words.
        raw = np.array(tensor.data, dtype=np.uint8).view(np.int16)
        out = torch.from_numpy(raw).view(torch.bfloat16)
    else:
        out = torch.from_numpy(dequantize(tensor.data, qtype))
    return out.reshape(shape)


def _undo_rope_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Put each head's Q/K rows back into Hugging Face order.

    llama.cpp stored head-local row ``2*j + h`` from HF row ``h*d/2 + j`` (h in {0, 1}, j < d/2), i.e.
    it interleaved the two rotary halves. Works for weights ``[rows, in]`` and biases ``[rows]``.
    """
    rows = w.shape[0]
    if rows % (2 * num_heads) != 0:
        raise ValueError(f"cannot split {rows} Q/K rows into {num_heads} heads of even size")
    half = rows // num_heads // 2
    # [heads, half, 2, ...] (GGUF order) → [heads, 2, half, ...] (HF order)
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _fix_layout(
    name: str, w: torch.Tensor, rules: _ArchRules, config: transformers.PretrainedConfig
) -> torch.Tensor:
    if rules.undo_rope_permute and (".attn_q." in name or ".attn_k." in name):
        num_heads = int(config.num_attention_heads)
        if ".attn_k." in name:
            num_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
        w = _undo_rope_permute(w, num_heads)
    if rules.norm_shift and name.endswith("norm.weight"):
        w = w - rules.norm_shift
    return w


def iter_weights(path: str, config: transformers.PretrainedConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every parameter in the file, dequantizing one tensor at a time.

    ``config`` must be the one ``load_config`` built (its head counts undo the Q/K permutation).
    Tensors are float32, or float16/bfloat16 when stored so; the model casts them to its dtype. A tied
    ``lm_head.weight`` is absent, as in the file.
    """
    if architecture(path) in gguf_moe.ARCHITECTURES:
        yield from gguf_moe.iter_weights(open_reader(path), architecture(path), _to_torch)
        return
    rules = _rules(path)
    for tensor in open_reader(path).tensors:
        name = hf_name(tensor.name, rules)
        if name is None:
            continue
        yield name, _fix_layout(tensor.name, _to_torch(tensor), rules, config)


def num_weight_tensors(path: str) -> int:
    """How many tensors ``iter_weights`` yields."""
    if architecture(path) in gguf_moe.ARCHITECTURES:
        return gguf_moe.num_weight_tensors(open_reader(path), architecture(path))
    return sum(1 for t in open_reader(path).tensors if t.name not in _SKIPPED)
