"""User-facing sampling parameters and their validation.

Shaped like vLLM's ``SamplingParams`` so code written for it runs unchanged. Every check raises
``ValueError`` naming the field and the bound it broke.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

_UNSET: Any = object()
# Checked to be finite (NaN passes every range comparison, so the range checks alone miss it).
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


@dataclass
class StructuredOutputsParams:
    """A constraint on what a completion may contain; exactly one field is set.

    ``json`` is a JSON schema given as JSON text (a string, so it crosses processes as a string and
    is cached by its text); ``json_object`` asks for any JSON object; ``regex`` must fullmatch the
    output; ``choice`` is a closed set of strings; ``grammar`` is an EBNF grammar (GBNF dialect, as
    xgrammar reads it). The grammar backend compiles it in the engine core; a constraint it cannot
    compile fails the request with a ValueError naming the problem, never an unconstrained output.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        chosen = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            chosen.append("json_object")
        if len(chosen) != 1:
            raise ValueError(
                "exactly one structured output constraint (json, json_object, regex, choice, grammar) "
                f"must be set, got {chosen or 'none'}"
            )
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) for c in self.choice)):
            raise ValueError("choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        """The name of the one constraint that is set."""
        if self.json_object:
            return "json_object"
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        raise AssertionError("unreachable: validated in __post_init__")


@dataclass
class SamplingParams:
    """How to sample one request's completions.

    ``temperature == 0`` means greedy. ``top_k`` of -1 (or 0) disables top-k; ``top_p`` of 1 and
    ``min_p`` of 0 disable those filters. ``logprobs``/``prompt_logprobs`` ask for that many top
    alternatives per position (0 returns only the chosen token's logprob). ``stop`` strings are never
    part of the returned text; ``stop_token_ids`` end a completion like EOS does. ``max_tokens=0``
    computes the prompt only (its KV enters the prefix cache, ``prompt_logprobs`` score it) and ends
    with finish reason ``length`` and no output token.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # The first prompt position whose logprob is wanted: the positions before it may come from the
    # prefix cache (their entries are None), as SGLang's ``logprob_start_len``.
    prompt_logprobs_start: int = 0
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    extra_args: dict[str, Any] = field(default_factory=dict)

    # Upper bound on top-N logprobs a request may ask for (OpenAI allows 20).
    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._validate()

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from a plain dict, rejecting unknown fields with a ValueError that names them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**values)

    def _validate(self) -> None:
        for name in _FLOAT_FIELDS:
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} > max_tokens={self.max_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= self.MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {self.MAX_LOGPROBS}], got {value}")
        if not isinstance(self.prompt_logprobs_start, int) or self.prompt_logprobs_start < 0:
            raise ValueError(
                f"prompt_logprobs_start must be an integer >= 0, got {self.prompt_logprobs_start!r}"
            )
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        assert isinstance(self.stop, list)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if self.logit_bias is not None:
            for token, bias in self.logit_bias.items():
                if not -100.0 <= bias <= 100.0:  # NaN fails this too
                    raise ValueError(f"logit_bias for token {token} must be in [-100, 100], got {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self, **changes: Any) -> SamplingParams:
        """A copy with some fields replaced (validated again)."""
        return dataclasses.replace(self, **changes)
