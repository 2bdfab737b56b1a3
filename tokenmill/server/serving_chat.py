"""``POST /v1/chat/completions``: chat template → engine → an OpenAI chat answer or SSE stream.

Streams follow OpenAI exactly: for each choice a first chunk with ``delta.role``, then content deltas,
then an empty delta carrying ``finish_reason``; with ``stream_options.include_usage`` a last chunk
with no choices and the usage; then ``data: [DONE]``. An engine failure mid-stream becomes one
``data: {"error": ...}`` event before ``[DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.frontend.output_processor import RequestState, SampleState
from tokenmill.server.context import (
    ServerContext,
    openai_finish_reason,
    request_user,
    take_delta,
    usage_of,
)
from tokenmill.server.errors import bad_request, from_engine_error
from tokenmill.server.logprobs import chat_logprobs
from tokenmill.server.openai_extensions import check_extensions, request_id_for
from tokenmill.server.openai_protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    now_seconds,
)
from tokenmill.server.sampling import build_sampling_params
from tokenmill.server.serving_tools import ChoiceOutput, plan_chat_tools, template_tool_calls
from tokenmill.server.streaming import (
    SSE_DONE,
    ClientDisconnected,
    SSEResponse,
    finish_streams,
    merge_streams,
    open_streams,
    sse,
)

# OpenAI's reasoning_effort values (gpt-oss's chat template reads the field).
REASONING_EFFORTS = ("low", "medium", "high")


MAX_TOP_LOGPROBS = 20


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them; text parts are joined, other parts refused."""
    result = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(
                        f"messages.{i}.content.{j}: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                        param=f"messages.{i}.content.{j}",
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        entry: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls is not None:
            entry["tool_calls"] = template_tool_calls(message.tool_calls, f"messages.{i}.tool_calls")
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        result.append(entry)
    return result


def render_chat_prompt(
    ctx: ServerContext,
    messages: list[ChatMessage],
    *,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[str, list[int]]:
    """The rendered conversation and its token ids; template problems are 400s on ``messages``."""
    processor = ctx.engine.input_processor
    try:
        text = processor.render_chat(
            template_messages(messages),
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            tools=tools,
            **(template_kwargs or {}),
        )
    except (ValueError, jinja2.TemplateError) as exc:
        raise bad_request(f"could not apply the chat template: {exc}", param="messages") from None
    return text, processor.tokenize(text, add_special_tokens=False)


def _check_supported(body: ChatCompletionRequest) -> None:
    """Refuse, rather than silently ignore, what this server cannot do yet."""
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {body.top_logprobs}",
                param="top_logprobs",
            )


async def create_chat_completion(body: ChatCompletionRequest, raw: Request, ctx: ServerContext) -> Response:
    ctx.check_alive()
    ctx.check_model(body.model)
    _check_supported(body)
    check_extensions(body, ctx)
    tool_plan = plan_chat_tools(body, ctx)
    if not body.separate_reasoning:
        tool_plan.reasoning_parser = None  # the reasoning stays in the content
    if not body.stream_reasoning and body.stream and tool_plan.reasoning_parser is not None:
        raise bad_request(
            "stream_reasoning false is not supported: reasoning streams as reasoning_content deltas",
            param="stream_reasoning",
        )
    template_kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:  # gpt-oss's template writes it into the system message
        if body.reasoning_effort not in REASONING_EFFORTS:
            raise bad_request(
                f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {body.reasoning_effort!r}",
                param="reasoning_effort",
            )
        template_kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    if body.continue_final_message:
        template_kwargs["continue_final_message"] = True
    num_top = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = build_sampling_params(body, max_tokens=max_tokens, logprobs=num_top, prompt_param="messages")
    tier = ctx.resolve_service_tier(body.service_tier)
    params = tool_plan.apply(params)
    prompt_text, prompt_ids = render_chat_prompt(
        ctx,
        body.messages,
        add_generation_prompt=body.add_generation_prompt,
        chat_template=body.chat_template,
        tools=tool_plan.template_tools,
        template_kwargs=template_kwargs,
    )
    outputs = tool_plan.choice_outputs(ctx, prompt_text, params.n)
    request_id = request_id_for(body, ctx, "chatcmpl")
    stream = ctx.engine.generate(
        request_id,
        prompt_ids,
        params,
        prompt=prompt_text,
        priority=body.priority,
        cache_salt=body.cache_salt,
        service_tier=tier,
        user=request_user(body.user, raw),
        timeout=body.timeout,
        lora_name=ctx.lora_name_for(body.model),
    )
    try:
        [state] = await open_streams(raw, [stream])
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as exc:
        raise from_engine_error(exc, "messages") from None
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return SSEResponse(
            _stream_chat(ctx, request_id, stream, state, num_top, include_usage, tier, outputs)
        )
    try:
        await finish_streams(raw, [stream])
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as exc:
        raise from_engine_error(exc, "messages") from None
    return JSONResponse(
        _chat_response(ctx, request_id, state, num_top, tier, outputs).model_dump(mode="json")
    )


def _chat_response(
    ctx: ServerContext,
    request_id: str,
    state: RequestState,
    num_top: int | None,
    tier: str,
    outputs: list[ChoiceOutput] | None = None,
) -> ChatCompletionResponse:
    choices = []
    for sample in state.samples:
        logprobs = None
        if num_top is not None and sample.logprobs is not None:
            logprobs = ChatLogprobs(content=chat_logprobs(sample.token_ids, sample.logprobs, num_top))
        message = ChatResponseMessage(content=sample.text)
        finish_reason = openai_finish_reason(sample.finish_reason)
        if outputs is not None:
            output = outputs[sample.index]
            parts = output.message(sample)
            message = ChatResponseMessage(
                content=parts.content,
                reasoning_content=parts.reasoning_content,
                tool_calls=[call.to_openai() for call in parts.tool_calls],
            )
            finish_reason = openai_finish_reason(output.finish_reason(sample))
        choices.append(
            ChatChoice(
                index=sample.index,
                message=message,
                logprobs=logprobs,
                finish_reason=finish_reason,
                stop_reason=sample.stop_reason,
            )
        )
    return ChatCompletionResponse(
        id=request_id, model=ctx.model_name, choices=choices, usage=usage_of([state]), service_tier=tier
    )


def _chunk_choices(
    sample: SampleState, num_top: int | None, finish_sent: set[int], output: ChoiceOutput | None = None
) -> list[ChatChunkChoice]:
    """The chunks a sample owes the client now: new content (with logprobs), then its finish."""
    if output is not None:
        return _parsed_chunk_choices(sample, num_top, finish_sent, output)
    delta = take_delta(sample)
    choices = []
    if delta.text or (num_top is not None and delta.logprobs):
        logprobs = None
        if num_top is not None:
            logprobs = ChatLogprobs(content=chat_logprobs(delta.token_ids, delta.logprobs, num_top))
        choices.append(ChatChunkChoice(index=sample.index, delta={"content": delta.text}, logprobs=logprobs))
    if sample.finish_reason is not None and sample.index not in finish_sent:
        finish_sent.add(sample.index)
        choices.append(
            ChatChunkChoice(
                index=sample.index,
                delta={},
                finish_reason=openai_finish_reason(sample.finish_reason),
                stop_reason=sample.stop_reason,
            )
        )
    return choices


async def _stream_chat(
    ctx: ServerContext,
    request_id: str,
    stream: AsyncGenerator[RequestState, None],
    state: RequestState,
    num_top: int | None,
    include_usage: bool,
    tier: str,
    outputs: list[ChoiceOutput] | None = None,
) -> AsyncGenerator[str, None]:
    created = now_seconds()

    def chunk(choices: list[ChatChunkChoice], usage: Any = None) -> str:
        return sse(
            ChatCompletionChunk(
                id=request_id,
                created=created,
                model=ctx.model_name,
                choices=choices,
                usage=usage,
                service_tier=tier,
            )
        )

    finish_sent: set[int] = set()
    try:
        for sample in state.samples:
            role = ChatChunkChoice(index=sample.index, delta={"role": "assistant", "content": ""})
            yield chunk([role])
        # The state may have moved on between acceptance and now: send that first, then follow it.
        for sample in state.samples:
            for choice in _chunk_choices(sample, num_top, finish_sent, _output_of(outputs, sample)):
                yield chunk([choice])
        async for _, current in merge_streams([stream]):
            for sample in current.samples:
                for choice in _chunk_choices(sample, num_top, finish_sent, _output_of(outputs, sample)):
                    yield chunk([choice])
        if include_usage:
            yield chunk([], usage=usage_of([state]))
    except Exception as exc:
        yield sse(from_engine_error(exc, "messages").body())
    finally:
        await stream.aclose()
    yield SSE_DONE


def _output_of(outputs: list[ChoiceOutput] | None, sample: SampleState) -> ChoiceOutput | None:
    return outputs[sample.index] if outputs is not None else None


def _parsed_chunk_choices(
    sample: SampleState, num_top: int | None, finish_sent: set[int], output: ChoiceOutput
) -> list[ChatChunkChoice]:
    """Like ``_chunk_choices``, with the text going through the choice's tool/reasoning parsers.

    Parsers may hold text back (a tag not yet complete), so a step's logprobs wait in the sample's
    unsent tokens until a chunk goes out; the finish chunk carries whatever is left.
    """
    finishing = sample.finish_reason is not None and sample.index not in finish_sent
    text = sample.text[sample.sent_text :]
    sample.sent_text = len(sample.text)
    deltas = output.deltas(sample, text, finishing)
    choices = []
    for delta in deltas:
        choices.append(
            ChatChunkChoice(index=sample.index, delta=delta, logprobs=_take_logprobs(sample, num_top))
        )
    if finishing:
        finish_sent.add(sample.index)
        choices.append(
            ChatChunkChoice(
                index=sample.index,
                delta={},
                logprobs=_take_logprobs(sample, num_top),
                finish_reason=openai_finish_reason(output.finish_reason(sample)),
                stop_reason=sample.stop_reason,
            )
        )
    return choices


def _take_logprobs(sample: SampleState, num_top: int | None) -> ChatLogprobs | None:
    if num_top is None:
        return None
    delta = take_delta(sample)  # its text was taken already; this takes the unsent tokens and logprobs
    if not delta.logprobs:
        return None
    return ChatLogprobs(content=chat_logprobs(delta.token_ids, delta.logprobs, num_top))
