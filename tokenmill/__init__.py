"""tokenmill: an LLM inference and serving engine.

``LLM`` is imported on first use so that light commands (the benchmark client) start without torch.
"""

from typing import TYPE_CHECKING, Any

from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.llm import LLM

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from tokenmill.llm import LLM

        return LLM
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
