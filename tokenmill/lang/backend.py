"""What a program needs from a model server: the ``Backend`` interface and its result types.

Three implementations: ``Runtime`` (the engine in this process), ``Endpoint`` (a tokenmill or
SGLang server through ``/generate``) and ``OpenAIEndpoint`` (any OpenAI-compatible server).
Every method is called from many threads at once (forks and ``run_batch`` run in parallel) and must
be thread-safe; each returns the call's token counts so the trace can show what the cache saved.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.lang.chat_roles import ChatRoles
from tokenmill.lang.expr import Gen

TextCallback = Callable[[str], None]


@dataclass
class CallResult:
    """One model call: the generated text and what it cost."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str | None = None


@dataclass
class ChoiceScores:
    """``select``'s answer: each choice's token-length-normalised logprob, and the call's cost."""

    normalized_logprobs: list[float]
    token_logprobs: list[list[float]]
    call: CallResult

    def best(self) -> int:
        """The index of the highest score (the first one on a tie)."""
        return max(range(len(self.normalized_logprobs)), key=lambda i: self.normalized_logprobs[i])


@dataclass
class ChatTurns:
    """A conversation rendered for a tool loop: its messages and the tool definitions."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)


class Backend(ABC):
    """A model to run programs on. Thread-safe; every call is one request (or one batch) to the model."""

    @abstractmethod
    def generate(self, prompt: str, gen: Gen, on_text: TextCallback | None = None) -> CallResult:
        """Complete ``prompt`` under ``gen``'s sampling settings (``gen.tools`` is ignored here);
        ``on_text`` receives the text as it is produced. ValueError for a refused request."""

    @abstractmethod
    def score_choices(self, prompt: str, choices: Sequence[str]) -> ChoiceScores:
        """Score each ``prompt + choice`` by the mean logprob of the choice's tokens, in one
        prompt-only request (no token is generated)."""

    @abstractmethod
    def prime(self, prompt: str) -> CallResult:
        """Compute ``prompt`` into the prefix cache without generating (``max_tokens`` 0)."""

    @abstractmethod
    def chat_roles(self) -> ChatRoles:
        """The model's chat template as role prefixes and suffixes (ValueError if it has none)."""

    @abstractmethod
    def render_chat(self, turns: ChatTurns) -> str:
        """``turns`` through the model's chat template, ending with the assistant's generation prompt."""

    def chat_template_source(self) -> str | None:
        """The chat template's Jinja text, when the backend knows it (None otherwise)."""
        return None

    def tool_parser_name(self) -> str | None:
        """The model's tool-call format, detected from its chat template (None when unknown)."""
        return None

    def close(self) -> None:  # noqa: B027 (most backends hold nothing to release)
        """Release what the backend holds (threads, connections, the engine)."""


def choice_span(prompt_ids: Sequence[int], full_ids: Sequence[int]) -> int:
    """Where a choice's tokens start in the tokens of ``prompt + choice``.

    Tokenizing the joined text may merge the prompt's last token with the choice's first, so the
    choice starts after the longest common prefix of the two tokenizations; at least one token is
    scored and never the first (which has no logprob).
    """
    common = 0
    for a, b in zip(prompt_ids, full_ids):
        if a != b:
            break
        common += 1
    return max(1, min(common, len(full_ids) - 1))


def normalized_logprob(values: Sequence[float]) -> float:
    """The mean of a choice's token logprobs (SGLang's ``normalized_prompt_logprobs``)."""
    return sum(values) / len(values)


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a state's text: special tokens are added (a BOS) unless the text already starts
    with the BOS token (a chat template wrote it)."""
    bos = getattr(tokenizer, "bos_token", None)
    add_special = not (bos and text.startswith(bos))
    return list(tokenizer.encode(text, add_special_tokens=add_special))


def check_choices(choices: Sequence[str]) -> list[str]:
    options = list(choices)
    if not options or any(not isinstance(c, str) or not c for c in options):
        raise ValueError("select needs a non-empty list of non-empty strings")
    return options
