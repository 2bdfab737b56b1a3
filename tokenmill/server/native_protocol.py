"""Pydantic models of the SGLang-native API's request bodies (``/generate``, ``/abort_request``,
``/flush_cache``), under SGLang's field names so its clients (the ``sglang`` frontend's
``RuntimeEndpoint``, RL frameworks) work unchanged.

Every field SGLang's clients send may be ``null``, meaning "the default" (the frontend sends every
sampling field, most of them null). Unknown fields are a 400 naming them. Fields SGLang has that
tokenmill does not serve (images, LoRA paths, sessions, hidden states...) are accepted only while
unset (null, false or empty), so a client that sends them with their defaults works, and one that
asks for the feature gets a 400 naming it instead of a silently different answer.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

# SGLang's default when a request gives no max_new_tokens (an explicit null means "up to the window").
DEFAULT_MAX_NEW_TOKENS = 128


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NativeSamplingParams(_Strict):
    """SGLang's ``sampling_params`` object (one per request, or one per prompt of a batch)."""

    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    n: int | None = Field(default=None, ge=1, le=128)
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None
    seed: int | None = None
    sampling_seed: int | None = None  # SGLang's newer name for ``seed``
    logit_bias: dict[str, float] | None = None
    # SGLang fields tokenmill does not serve: accepted only while unset.
    stop_regex: str | list[str] | None = None
    structural_tag: str | None = None
    custom_params: dict[str, Any] | None = None
    stream_interval: int | None = None

    UNSUPPORTED: ClassVar[tuple[str, ...]] = (
        "stop_regex",
        "structural_tag",
        "custom_params",
        "stream_interval",
    )


class GenerateRequest(_Strict):
    """The body of ``POST /generate``: exactly one of ``text`` and ``input_ids``, each a single prompt
    or a list (a batch). Per-prompt fields (``sampling_params``, ``rid``, ``return_logprob``,
    ``logprob_start_len``, ``top_logprobs_num``, ``cache_salt``) are one value for all or a list with
    one per prompt."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    cache_salt: str | list[str] | None = None
    # No effect here (request metrics are always kept).
    log_metrics: bool = True
    # SGLang fields tokenmill does not serve: accepted only while unset.
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    modalities: Any = None
    lora_path: Any = None
    lora_id: Any = None
    session_params: Any = None
    custom_logit_processor: Any = None
    token_ids_logprob: Any = None
    return_hidden_states: Any = None
    priority: int | None = None
    data_parallel_rank: int | None = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None

    UNSUPPORTED: ClassVar[tuple[str, ...]] = (
        "input_embeds",
        "image_data",
        "video_data",
        "audio_data",
        "modalities",
        "lora_path",
        "lora_id",
        "session_params",
        "custom_logit_processor",
        "token_ids_logprob",
        "return_hidden_states",
        "priority",
        "data_parallel_rank",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
    )


def unsupported_fields_set(model: BaseModel) -> list[str]:
    """The names in ``model.UNSUPPORTED`` that the request sets (to anything but null, false or empty)."""
    names: tuple[str, ...] = getattr(model, "UNSUPPORTED", ())
    return [name for name in names if getattr(model, name) not in (None, False, [], {}, "")]


class AbortRequest(_Strict):
    """``POST /abort_request``: end the requests sent with ``rid`` (or every request, ``abort_all``)."""

    rid: str = ""
    abort_all: bool = False
    abort_message: str | None = None


class FlushCacheRequest(_Strict):
    """``POST /flush_cache``'s optional body (the SGLang frontend sends ``empty_cache``)."""

    empty_cache: bool = True
