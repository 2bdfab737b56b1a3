"""Pydantic models of the OpenAI API as tokenmill serves it: request bodies and response shapes.

Request models forbid unknown fields, so a misspelt parameter is a 400 naming it rather than being
silently ignored; chat and text completions keep unknown top-level fields for the server's
``--unknown-fields`` policy (``reject``: that 400; ``warn``: ignored and listed in ``X-Ignored-Fields``). Fields OpenAI clients commonly send that have no effect here (``store``,
``metadata``...) are accepted and ignored; ``user`` names whose fair share a request uses and
``service_tier`` picks its scheduling tier (echoed in the response). Extensions beyond OpenAI follow
vLLM's names (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``,
``stop_token_ids``, ``priority``: lower values first...) and SGLang's (``regex``, ``ebnf``,
``no_stop_trim``, ``rid``, ``separate_reasoning``...: see ``openai_extensions.py``); ``timeout`` (seconds) ends a request that
is still running or waiting with ``finish_reason: "length"`` and ``stop_reason: "timeout"``.
Response models are built by the serving code and dumped with every field, as OpenAI does.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

# ---------------------------------------------------------------------------------------------------
# requests


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingRequest(_Strict):
    """Fields shared by chat and text completions."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=128)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = Field(default=0, ge=-(2**63), lt=2**63)
    cache_salt: str | None = None
    user: str | None = None
    service_tier: str | None = None
    timeout: float | None = Field(default=None, gt=0)
    # Accepted for compatibility; they change nothing here.
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    # Structured outputs under vLLM's names (at most one; chat also takes response_format).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # SGLang's extensions (see server/openai_extensions.py): regex / ebnf constraints, keeping the
    # stop string, the request id; the fields in UNSUPPORTED are a 400 when set.
    regex: str | None = None
    ebnf: str | None = None
    no_stop_trim: bool = False
    spaces_between_special_tokens: bool = True
    rid: str | None = None
    lora_path: Any = None
    return_hidden_states: bool = False
    use_beam_search: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None

    UNSUPPORTED: ClassVar[tuple[str, ...]] = (
        "lora_path",
        "return_hidden_states",
        "use_beam_search",
        "allowed_token_ids",
        "bad_words",
        "truncate_prompt_tokens",
    )


class ChatMessage(_Strict):
    """One conversation turn; ``content`` is a string or a list of ``{"type": "text", "text": ...}`` parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingRequest):
    # Unknown top-level fields are kept here and refused (or ignored) by --unknown-fields.
    model_config = ConfigDict(extra="allow")

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    reasoning_effort: str | None = None  # OpenAI's low | medium | high, given to the chat template


PromptField = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingRequest):
    model_config = ConfigDict(extra="allow")

    prompt: PromptField
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True


class TokenizeRequest(_Strict):
    """Either ``prompt`` (text) or ``messages`` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------------------------------------
# responses


def now_seconds() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_seconds)
    owned_by: str = "tokenmill"
    max_model_len: int
    root: str | None = None  # a LoRA adapter's folder
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_seconds)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    service_tier: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: dict[str, Any]  # only the keys that changed: role, content, reasoning_content, tool_calls
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    service_tier: str | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_seconds)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None
    system_fingerprint: str | None = None
    service_tier: str | None = None
