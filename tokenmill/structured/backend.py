"""The grammar backend interface, so the engine does not depend on one grammar library.

A backend compiles a :class:`~tokenmill.sampling_params.StructuredOutputsParams` against the
model's vocabulary once (the slow part, done off the step loop) and makes a cheap matcher per
sequence. Bitmasks are int32 tensors of ``ceil(vocab_size / 32)`` words per row; bit ``t % 32`` of
word ``t // 32`` set means token ``t`` is allowed.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from tokenmill.sampling_params import StructuredOutputsParams


class GrammarMatcher(abc.ABC):
    """One sequence's position in a compiled grammar.

    Contract: ``accept_token`` advances by one token and returns False (leaving the state unchanged)
    for a token the grammar does not allow; ``fill_bitmask`` writes the allowed next tokens into one
    row; ``rollback(n)`` undoes the last ``n`` accepted tokens; ``is_terminated`` is true once a stop
    token ended the grammar.
    """

    @abc.abstractmethod
    def accept_token(self, token_id: int) -> bool: ...

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None: ...

    @abc.abstractmethod
    def is_terminated(self) -> bool: ...

    @abc.abstractmethod
    def forced_string(self) -> str:
        """The longest text every completion of the grammar continues with from here ('' if none)."""


class GrammarBackend(abc.ABC):
    """Compiles constraints for one vocabulary and makes matchers.

    Contract: ``compile`` raises ValueError naming the problem for a constraint it cannot enforce
    (never returns something weaker); it may be called from worker threads. ``make_matcher`` is
    cheap and its matcher ends the grammar on any of ``stop_token_ids``.
    """

    vocab_size: int

    @abc.abstractmethod
    def compile(self, constraint: StructuredOutputsParams) -> Any: ...

    @abc.abstractmethod
    def make_matcher(self, compiled: Any, stop_token_ids: list[int]) -> GrammarMatcher: ...

    def token_filter(self, constraint: StructuredOutputsParams) -> torch.Tensor | None:
        """A ``[words]`` bitmask ANDed into every mask of this constraint, for tokens the compiled
        grammar lets through wrongly (a backend bug workaround), or None."""
        return None

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """An all-allowed ``[num_rows, ceil(vocab_size / 32)]`` int32 bitmask."""
        words = (self.vocab_size + 31) // 32
        return torch.full((num_rows, words), -1, dtype=torch.int32)  # [num_rows, words]


def constraint_key(constraint: StructuredOutputsParams) -> tuple[str, str]:
    """The cache key of a constraint: its kind and its text (choices joined unambiguously)."""
    kind = constraint.kind
    if kind == "json":
        return kind, constraint.json or ""
    if kind == "json_object":
        return kind, ""
    if kind == "choice":
        return kind, "\x00".join(constraint.choice or [])
    return kind, getattr(constraint, kind) or ""
