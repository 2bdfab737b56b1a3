"""``ModelSource``: a model resolved from a name or path to files on disk, ready to load.

``resolve_model`` accepts a bundled alias (see ``bundled.py``), a Hugging Face model folder, a
``.gguf`` file, or a folder holding exactly one ``.gguf`` file. It reads the config eagerly (so a bad
model fails at startup) and leaves tokenizer and weights to be loaded on demand.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import transformers

from tokenmill.config import gguf_conversion_enabled
from tokenmill.loader import converted_cache, fp8_blocks, gguf_loader, hf_loader
from tokenmill.loader.bundled import BUNDLED_MODELS, bundled_names, locate_bundled

logger = logging.getLogger(__name__)

FORMATS = ("hf", "gguf")


@dataclass
class ModelSource:
    """A resolved model: where it is, its HF config, how to get its tokenizer and weights."""

    name: str  # what the user asked for (alias or path)
    path: str  # folder ("hf") or .gguf file ("gguf")
    format: str  # "hf" or "gguf"
    hf_config: transformers.PretrainedConfig
    # The .gguf file the weights come from, also when they load from its converted folder ("hf"):
    # the model runner reads its Q4_K tensors' exact groups from it (loader/gguf_k4.py). None otherwise.
    gguf_path: str | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown model format {self.format!r}; expected one of {FORMATS}")

    def load_tokenizer(self) -> transformers.PreTrainedTokenizerBase:
        """The model's tokenizer; ``chat_template`` is set when the model ships one."""
        if self.format == "gguf":
            return gguf_loader.load_tokenizer(self.path)
        return hf_loader.load_tokenizer(self.path)

    def iter_weights(self, only: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` one at a time under Hugging Face parameter names.

        E.g. ``model.layers.0.self_attn.q_proj.weight``; ``lm_head.weight`` is absent when the
        embeddings are tied and the checkpoint leaves it out. Tensors are in Hugging Face layout on
        CPU; their dtype is the checkpoint's (float32 for quantized GGUF), to be cast by the model.
        ``only`` selects tensors by name (an fp8 weight's scale comes with it), reading no others from
        safetensors.
        """
        if self.format == "gguf":
            weights = gguf_loader.iter_weights(self.path, self.hf_config)
            return weights if only is None else ((n, t) for n, t in weights if only(n))
        block = fp8_blocks.fp8_block_size(self.hf_config)
        if block is not None:  # fp8 block-quantized: dequantized as it streams (fp8_blocks.py)
            if only is None:
                fp8_blocks.log_memory_needed(hf_loader.weight_files(self.path)[1], block)
            wanted = None if only is None else (lambda n: only(n.removesuffix(fp8_blocks.SCALE_SUFFIX)))
            return fp8_blocks.dequantize_stream(hf_loader.iter_weights(self.path, wanted), block)
        return hf_loader.iter_weights(self.path, only)

    def num_weight_tensors(self) -> int:
        """How many tensors ``iter_weights`` yields (for progress reporting)."""
        if self.format == "gguf":
            return gguf_loader.num_weight_tensors(self.path)
        if fp8_blocks.fp8_block_size(self.hf_config) is not None:  # the scales are not yielded
            num_scales = fp8_blocks.describe_fp8_checkpoint(hf_loader.weight_files(self.path)[1])[2]
            return hf_loader.num_weight_tensors(self.path) - num_scales
        return hf_loader.num_weight_tensors(self.path)


def _locate(name_or_path: str) -> str:
    if name_or_path in BUNDLED_MODELS:
        # An alias wins over a same-named folder in the working directory; "./name" reaches the folder.
        return locate_bundled(name_or_path)
    path = os.path.abspath(os.path.expanduser(name_or_path))
    if not os.path.exists(path):
        raise ValueError(
            f"unknown model {name_or_path!r}: not a bundled model and no such file or folder "
            f"(models are never downloaded from a hub). Bundled models: {bundled_names()}"
        )
    return path


def _format_of(path: str) -> tuple[str, str]:
    """Return ``(format, path)``, narrowing a folder that holds one GGUF file to that file."""
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return "gguf", path
        raise ValueError(f"{path!r} is a file but not a .gguf file; pass a model folder or a .gguf file")
    if hf_loader.is_hf_folder(path):
        return "hf", path
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(ggufs) == 1:
        return "gguf", ggufs[0]
    if ggufs:
        raise ValueError(f"{path!r} holds several .gguf files; pass one of them: {ggufs}")
    raise ValueError(f"{path!r} is neither a Hugging Face model folder (no config.json) nor has a .gguf file")


def resolve_model(name_or_path: str) -> ModelSource:
    """Resolve a bundled alias, model folder or ``.gguf`` file into a ``ModelSource``.

    Reads the config (and, for GGUF, checks the architecture is one whose weights we can map) so that
    an unusable model fails here. Raises ``ValueError`` for unknown names, missing bundled packages
    (with the install command) and unsupported files; never touches the network.
    """
    fmt, path = _format_of(_locate(name_or_path))
    if fmt == "gguf":
        # The converted folder first: checking the GGUF itself means parsing its metadata (seconds).
        cached = converted_cache.cached_folder(path) if gguf_conversion_enabled() else None
        if cached is not None:
            logger.info("loading %s from its converted copy %s", path, cached)
            return ModelSource(
                name=name_or_path,
                path=cached,
                format="hf",
                hf_config=hf_loader.load_config(cached),
                gguf_path=path,
            )
        gguf_loader.check_supported(path)
        if gguf_conversion_enabled():
            folder = _converted(path)
            if folder is not None:
                return ModelSource(
                    name=name_or_path,
                    path=folder,
                    format="hf",
                    hf_config=hf_loader.load_config(folder),
                    gguf_path=path,
                )
        config = gguf_loader.load_config(path)
    else:
        config = hf_loader.load_config(path)
    return ModelSource(
        name=name_or_path, path=path, format=fmt, hf_config=config, gguf_path=path if fmt == "gguf" else None
    )


def _converted(gguf_path: str) -> str | None:
    """Convert a GGUF file into its cached folder (see converted_cache.py) and return the folder;
    None when that is not possible, in which case the GGUF is read directly."""
    gguf = ModelSource(
        name=gguf_path, path=gguf_path, format="gguf", hf_config=gguf_loader.load_config(gguf_path)
    )
    try:
        tokenizer = gguf.load_tokenizer()
    except Exception as exc:  # a GGUF without a usable tokenizer: keep the GGUF path, which reports it
        logger.info("not converting %s: its tokenizer does not load (%s)", gguf_path, exc)
        return None
    folder = converted_cache.convert(gguf_path, gguf.hf_config, tokenizer, gguf.iter_weights())
    if folder is None:
        logger.warning("could not cache the converted GGUF %s; reading the GGUF directly", gguf_path)
    return folder
