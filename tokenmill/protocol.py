"""Messages that cross the boundary between the frontend and the engine core.

Only these msgspec structs travel between processes (encoded with msgspec, never pickle). The
offline API passes the same objects in-process. They hold ints, floats, strings and lists.
"""

from __future__ import annotations

import enum

import msgspec

from tokenmill.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    """Why a sequence ended; the values are what the OpenAI API reports."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # cancelled by the client or the server
    ERROR = "error"  # an engine fault hit this request


class EngineCoreRequest(msgspec.Struct, kw_only=True):
    """One sequence for the engine core to generate.

    ``eos_token_ids`` end generation unless ``sampling_params.ignore_eos``. ``group_id`` and
    ``sibling_index`` tie the n samples of one user request together so siblings share the
    prompt's KV blocks. ``cache_salt`` keeps requests from sharing cached KV with other salts.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = []
    arrival_time: float = 0.0
    priority: int = 0
    group_id: str | None = None
    sibling_index: int = 0
    cache_salt: str | None = None


class PositionLogprobs(msgspec.Struct, array_like=True):
    """Log-probabilities at one position.

    ``token_ids[0]`` is the chosen token (sampled, or the actual next prompt token) and the rest are
    the top alternatives in descending order; ``rank`` is the chosen token's rank (1 = most likely).
    """

    token_ids: list[int]
    logprobs: list[float]
    rank: int


class EngineCoreOutput(msgspec.Struct, kw_only=True):
    """What one step produced for one sequence.

    ``prompt_logprobs`` arrives once, with the first output of the request; its first entry is None
    (the first prompt token has no context). ``num_cached_tokens`` is the prompt prefix served from
    the prefix cache. ``finish_reason`` is set on the sequence's last output.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None


class EngineCoreOutputs(msgspec.Struct, kw_only=True):
    """A batch of outputs from one engine step, plus gauges the frontend exports as metrics."""

    outputs: list[EngineCoreOutput]
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
