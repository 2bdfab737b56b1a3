"""``POST /v1/completions``: one or more prompts (text or token ids) → engine → OpenAI text completions.

Choice ``index`` is ``prompt_index * n + sample_index``, as OpenAI numbers them. ``echo`` puts the
prompt text (and, with ``logprobs``, the prompt tokens' logprobs) in front of each completion.
Streams send text deltas, then a chunk with ``finish_reason`` per choice, an optional usage chunk and
``data: [DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass

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
from tokenmill.server.logprobs import completion_logprobs, extend_completion_logprobs
from tokenmill.server.openai_extensions import check_extensions, request_id_for
from tokenmill.server.openai_protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    now_seconds,
)
from tokenmill.server.sampling import build_sampling_params
from tokenmill.server.streaming import (
    SSE_DONE,
    ClientDisconnected,
    SSEResponse,
    finish_streams,
    follow_streams,
    open_streams,
    sse,
)

# The legacy API caps logprobs at 5; we allow what SamplingParams allows.
MAX_COMPLETION_LOGPROBS = 20


@dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]


def _encode_prompts(ctx: ServerContext, body: CompletionRequest) -> list[_Prompt]:
    prompt = body.prompt
    processor = ctx.engine.input_processor
    if isinstance(prompt, str):
        return [_Prompt(prompt, processor.tokenize(prompt, body.add_special_tokens))]
    if not prompt:
        raise bad_request("prompt must not be an empty list", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return [_Prompt(p, processor.tokenize(p, body.add_special_tokens)) for p in prompt]  # type: ignore[arg-type]
    if all(isinstance(p, int) for p in prompt):
        return [_Prompt(None, list(prompt))]  # type: ignore[arg-type]
    return [_Prompt(None, list(p)) for p in prompt]  # type: ignore[arg-type]


def _check_supported(body: CompletionRequest) -> None:
    if body.suffix is not None:
        raise bad_request("suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of other than n is not supported", param="best_of")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise bad_request(
            f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {body.logprobs}", param="logprobs"
        )


async def create_completion(body: CompletionRequest, raw: Request, ctx: ServerContext) -> Response:
    ctx.check_alive()
    ctx.check_model(body.model)
    _check_supported(body)
    check_extensions(body, ctx)
    prompts = _encode_prompts(ctx, body)
    echo_logprobs = body.logprobs if body.echo else None
    params = build_sampling_params(
        body, max_tokens=body.max_tokens, logprobs=body.logprobs, prompt_logprobs=echo_logprobs
    )
    tier = ctx.resolve_service_tier(body.service_tier)
    user = request_user(body.user, raw)
    request_id = request_id_for(body, ctx, "cmpl")
    streams = [
        ctx.engine.generate(
            request_id if len(prompts) == 1 else f"{request_id}-p{i}",
            p.token_ids,
            params,
            prompt=p.text,
            priority=body.priority,
            cache_salt=body.cache_salt,
            service_tier=tier,
            user=user,
            timeout=body.timeout,
            lora_name=ctx.lora_name_for(body.model),
        )
        for i, p in enumerate(prompts)
    ]
    try:
        states = await open_streams(raw, streams)
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as exc:
        raise from_engine_error(exc, "prompt") from None
    formatter = _Formatter(ctx, body, prompts)
    if body.stream:
        return SSEResponse(_stream_completions(ctx, body, request_id, streams, states, formatter, tier))
    try:
        await finish_streams(raw, streams)
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as exc:
        raise from_engine_error(exc, "prompt") from None
    choices = [
        formatter.full_choice(i, state, sample) for i, state in enumerate(states) for sample in state.samples
    ]
    response = CompletionResponse(
        id=request_id, model=ctx.model_name, choices=choices, usage=usage_of(states), service_tier=tier
    )
    return JSONResponse(response.model_dump(mode="json"))


@dataclass
class _Cursor:
    """Per-choice streaming progress."""

    started: bool = False
    finish_sent: bool = False
    offset: int = 0  # characters of this choice's text sent so far (for text_offset)


class _Formatter:
    """Builds choices (whole or as deltas) for one completions request."""

    def __init__(self, ctx: ServerContext, body: CompletionRequest, prompts: list[_Prompt]) -> None:
        self.ctx = ctx
        self.n = body.n
        self.echo = body.echo
        self.num_top = body.logprobs
        self.prompts = prompts
        self._prompt_texts: dict[int, str] = {}

    def index(self, prompt_index: int, sample: SampleState) -> int:
        return prompt_index * self.n + sample.index

    def prompt_text(self, prompt_index: int) -> str:
        if prompt_index not in self._prompt_texts:
            prompt = self.prompts[prompt_index]
            if prompt.text is not None:
                self._prompt_texts[prompt_index] = prompt.text
            else:
                self._prompt_texts[prompt_index] = str(self.ctx.engine.tokenizer.decode(prompt.token_ids))
        return self._prompt_texts[prompt_index]

    def prompt_logprobs(self, state: RequestState) -> CompletionLogprobs:
        positions = state.prompt_logprobs or [None] * len(state.prompt_token_ids)
        texts = [self.ctx.engine.output_processor.token_text(t) for t in state.prompt_token_ids]
        assert self.num_top is not None
        return completion_logprobs(state.prompt_token_ids, positions, self.num_top, 0, texts)

    def full_choice(self, prompt_index: int, state: RequestState, sample: SampleState) -> CompletionChoice:
        text = sample.text
        logprobs = None
        prefix = self.prompt_text(prompt_index) if self.echo else ""
        if self.num_top is not None:
            logprobs = self.prompt_logprobs(state) if self.echo else CompletionLogprobs()
            generated = completion_logprobs(
                sample.token_ids, sample.logprobs or [], self.num_top, len(prefix)
            )
            extend_completion_logprobs(logprobs, generated)
        return CompletionChoice(
            index=self.index(prompt_index, sample),
            text=prefix + text,
            logprobs=logprobs,
            finish_reason=openai_finish_reason(sample.finish_reason),
            stop_reason=sample.stop_reason,
        )

    def delta_choices(
        self, prompt_index: int, state: RequestState, sample: SampleState, cursor: _Cursor
    ) -> list[CompletionChoice]:
        """The choices a sample owes the client now: new text (and logprobs), then its finish."""
        delta = take_delta(sample)
        text = delta.text
        logprobs = CompletionLogprobs() if self.num_top is not None else None
        if not cursor.started:
            cursor.started = True
            if self.echo:
                text = self.prompt_text(prompt_index) + text
                if logprobs is not None:
                    logprobs = self.prompt_logprobs(state)
                cursor.offset = len(self.prompt_text(prompt_index))
        if logprobs is not None and self.num_top is not None and delta.token_ids:
            generated = completion_logprobs(delta.token_ids, delta.logprobs, self.num_top, cursor.offset)
            extend_completion_logprobs(logprobs, generated)
        cursor.offset += len(delta.text)
        index = self.index(prompt_index, sample)
        choices = []
        if text or (logprobs is not None and logprobs.tokens):
            choices.append(CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=None))
        if sample.finish_reason is not None and not cursor.finish_sent:
            cursor.finish_sent = True
            choices.append(
                CompletionChoice(
                    index=index,
                    text="",
                    finish_reason=openai_finish_reason(sample.finish_reason),
                    stop_reason=sample.stop_reason,
                )
            )
        return choices


async def _stream_completions(
    ctx: ServerContext,
    body: CompletionRequest,
    request_id: str,
    streams: list[AsyncGenerator[RequestState, None]],
    states: list[RequestState],
    formatter: _Formatter,
    tier: str,
) -> AsyncGenerator[str, None]:
    created = now_seconds()
    cursors: dict[int, _Cursor] = {}

    def chunks(prompt_index: int, state: RequestState) -> list[str]:
        out = []
        for sample in state.samples:
            cursor = cursors.setdefault(formatter.index(prompt_index, sample), _Cursor())
            for choice in formatter.delta_choices(prompt_index, state, sample, cursor):
                response = CompletionResponse(
                    id=request_id,
                    created=created,
                    model=ctx.model_name,
                    choices=[choice],
                    usage=None,
                    service_tier=tier,
                )
                out.append(sse(response))
        return out

    try:
        async for event in follow_streams(states, streams, chunks):
            yield event
        if body.stream_options is not None and body.stream_options.include_usage:
            usage = CompletionResponse(
                id=request_id,
                created=created,
                model=ctx.model_name,
                choices=[],
                usage=usage_of(states),
                service_tier=tier,
            )
            yield sse(usage)
    except Exception as exc:
        yield sse(from_engine_error(exc, "prompt").body())
    finally:
        for stream in streams:
            await stream.aclose()
    yield SSE_DONE
