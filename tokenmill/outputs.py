"""Results of the offline API, shaped like vLLM's so code written for it runs unchanged."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One candidate token's log-probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's candidates: token id -> Logprob (the chosen token first, then the top-N).
PositionLogprobDict = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobDict] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # The weight version that produced each token (RL: tokens from before an update are off-policy).
    weight_versions: list[str] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and its completions; ``finished`` once every completion has ended."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobDict | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
