"""Turn an OpenAI request's sampling fields into ``SamplingParams``, with 400s that name the field."""

from __future__ import annotations

from typing import Any

from tokenmill.sampling_params import SamplingParams
from tokenmill.server.errors import bad_request, from_value_error
from tokenmill.server.openai_protocol import SamplingRequest
from tokenmill.server.structured_outputs import structured_outputs_from_request

# OpenAI's documented range; SamplingParams itself accepts any temperature >= 0.
MAX_TEMPERATURE = 2.0


def logit_bias_from_json(raw: dict[str, float] | None) -> dict[int, float] | None:
    """JSON's string keys as token ids; a 400 naming ``logit_bias`` for a key that is not one."""
    if raw is None:
        return None
    bias: dict[int, float] = {}
    for key, value in raw.items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
    return bias


def build_sampling_params(
    request: SamplingRequest,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    prompt_param: str = "prompt",
) -> SamplingParams:
    """The request's ``SamplingParams``; unset OpenAI fields keep SamplingParams' defaults.

    Raises ``APIError`` 400 naming the offending field.
    """
    if request.temperature is not None and request.temperature > MAX_TEMPERATURE:
        raise bad_request(
            f"temperature must be in [0, {MAX_TEMPERATURE}], got {request.temperature}", param="temperature"
        )
    if (
        max_tokens is not None
        and max_tokens < 1
        and not (max_tokens == 0 and getattr(request, "echo", False))
    ):
        # SamplingParams allows 0 (prompt only, for the native /generate); the OpenAI API only with
        # legacy completions' echo, which scores the prompt (its prompt logprobs) as OpenAI's did.
        raise bad_request(
            f"max_tokens must be >= 1 (0 only with echo, to score the prompt), got {max_tokens}",
            param="max_tokens",
        )
    values: dict[str, Any] = {
        "n": request.n,
        "max_tokens": max_tokens,
        "min_tokens": request.min_tokens,
        "seed": request.seed,
        "stop": request.stop,
        "stop_token_ids": request.stop_token_ids,
        "include_stop_str_in_output": request.include_stop_str_in_output or request.no_stop_trim,
        "ignore_eos": request.ignore_eos,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "logit_bias": logit_bias_from_json(request.logit_bias),
        "skip_special_tokens": request.skip_special_tokens,
        "spaces_between_special_tokens": request.spaces_between_special_tokens,
    }
    optional = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
    }
    values.update({name: value for name, value in optional.items() if value is not None})
    values["structured_outputs"] = structured_outputs_from_request(request)
    try:
        return SamplingParams.from_dict(values)
    except ValueError as exc:
        raise from_value_error(exc, prompt_param) from None
