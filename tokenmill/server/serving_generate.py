"""``POST /generate``, SGLang's native generation API: text or token ids (one prompt or a batch) →
engine → ``{"text", "output_ids", "meta_info"}`` per output (a list for a batch).

Batch semantics follow SGLang: a batch, or one prompt with ``n > 1``, answers a list of
``batch_size * n`` outputs ordered sample-major (``[p0 s0, p1 s0, ..., p0 s1, p1 s1, ...]``).
Request ids: one prompt runs under ``rid`` (a fresh id when absent); prompt ``i`` of a batch under
``rid[i]`` (a list), ``f"{rid}_{i}"`` (a string) or a fresh id; with ``n > 1`` sample ``j`` reports
``f"{id}_{j}"``. ``/abort_request`` ends requests by these ids. ``max_new_tokens: 0`` computes the
prompt only (the engine samples nothing; its blocks enter the prefix cache), which with
``return_logprob`` and ``logprob_start_len`` scores a prompt. Streams send, per output and change, the
whole answer so far (text, ids and logprobs cumulative; batches add ``index``), then
``data: [DONE]``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.frontend.output_processor import RequestState
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.server.context import ServerContext, request_user
from tokenmill.server.errors import bad_request, from_engine_error
from tokenmill.server.native_output import LogprobOptions, OutputShaper
from tokenmill.server.native_protocol import GenerateRequest, NativeSamplingParams, unsupported_fields_set
from tokenmill.server.sampling import logit_bias_from_json
from tokenmill.server.streaming import (
    SSE_DONE,
    ClientDisconnected,
    SSEResponse,
    finish_streams,
    follow_streams,
    open_streams,
    sse,
)
from tokenmill.structured.validate import validate_constraint

# SamplingParams' names → the native API's, so a 400 names the field the client sent.
_NATIVE_NAMES = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "include_stop_str_in_output": "no_stop_trim",
    "prompt_logprobs": "top_logprobs_num",
    "logprobs": "top_logprobs_num",
}
_STRUCTURED_FIELDS = ("regex", "json_schema", "ebnf")


@dataclass
class GenerateItem:
    """One prompt of a ``/generate`` request, resolved."""

    rid: str
    text: str | None
    token_ids: list[int]
    params: SamplingParams
    options: LogprobOptions
    cache_salt: str | None


@dataclass
class GeneratePlan:
    """A whole ``/generate`` request: its prompts, whether the answer is a list, samples per prompt."""

    items: list[GenerateItem]
    is_batch: bool
    n: int
    prompt_param: str

    def output_id(self, prompt_index: int, sample_index: int) -> str:
        rid = self.items[prompt_index].rid
        return rid if self.n == 1 else f"{rid}_{sample_index}"

    def output_index(self, prompt_index: int, sample_index: int) -> int:
        return sample_index * len(self.items) + prompt_index


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    """One value per prompt: a list must have one per prompt; anything else is repeated."""
    if isinstance(value, list):
        if len(value) != count:
            raise bad_request(f"{name} has {len(value)} entries for {count} prompts", param=name)
        return list(value)
    return [value] * count


def _prompts(
    ctx: ServerContext, body: GenerateRequest
) -> tuple[list[tuple[str | None, list[int]]], bool, str]:
    """The prompts as (text, token ids), whether they came as a batch, and the field they came in."""
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("give exactly one of text and input_ids", param="text")
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        if not texts:
            raise bad_request("text must not be an empty list", param="text")
        tokenize = ctx.engine.input_processor.tokenize
        return [(t, tokenize(t)) for t in texts], isinstance(body.text, list), "text"
    assert body.input_ids is not None
    if not body.input_ids:
        raise bad_request("input_ids must not be empty", param="input_ids")
    if isinstance(body.input_ids[0], int):
        return [(None, list(body.input_ids))], False, "input_ids"  # type: ignore[arg-type]
    return [(None, list(ids)) for ids in body.input_ids], True, "input_ids"  # type: ignore[union-attr]


def _rids(rid: str | list[str] | None, count: int, is_batch: bool) -> list[str]:
    if isinstance(rid, list):
        return _per_prompt(rid, count, "rid")
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    return [rid] if not is_batch else [f"{rid}_{i}" for i in range(count)]


def _structured(sp: NativeSamplingParams) -> StructuredOutputsParams | None:
    given = [name for name in _STRUCTURED_FIELDS if getattr(sp, name) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(
            f"give at most one of regex, json_schema and ebnf, got {', '.join(given)}",
            param=f"sampling_params.{given[1]}",
        )
    name = given[0]
    try:
        if name == "regex":
            constraint = StructuredOutputsParams(regex=sp.regex)
        elif name == "json_schema":
            schema = sp.json_schema
            constraint = StructuredOutputsParams(
                json=schema if isinstance(schema, str) else json.dumps(schema)
            )
        else:
            constraint = StructuredOutputsParams(grammar=sp.ebnf)
        validate_constraint(constraint)
    except ValueError as exc:
        raise bad_request(str(exc), param=f"sampling_params.{name}") from None
    return constraint


def _native_message(exc: ValueError) -> tuple[str, str | None]:
    """A SamplingParams error in the native API's names, and the field it names."""
    message = str(exc)
    first = message.split(" ", 1)[0]
    for ours, theirs in _NATIVE_NAMES.items():
        message = re.sub(rf"\b{ours}\b", theirs, message)
    name = _NATIVE_NAMES.get(first, first)
    if name == "top_logprobs_num":
        return message, name
    if name in NativeSamplingParams.model_fields:
        return message, f"sampling_params.{name}"
    return message, None


def build_native_params(sp: NativeSamplingParams, options: LogprobOptions) -> SamplingParams:
    """The ``SamplingParams`` of one prompt; 400 naming the native field that is wrong."""
    unsupported = unsupported_fields_set(sp)
    if unsupported:
        name = unsupported[0]
        raise bad_request(f"sampling_params.{name} is not supported", param=f"sampling_params.{name}")
    values: dict[str, Any] = {
        "n": sp.n or 1,
        "max_tokens": sp.max_new_tokens,
        "min_tokens": sp.min_new_tokens or 0,
        "seed": sp.seed if sp.seed is not None else sp.sampling_seed,
        "stop": sp.stop,
        "stop_token_ids": sp.stop_token_ids,
        "include_stop_str_in_output": bool(sp.no_stop_trim),
        "ignore_eos": bool(sp.ignore_eos),
        "logprobs": options.top_logprobs_num if options.return_logprob else None,
        "prompt_logprobs": (
            options.top_logprobs_num if options.return_logprob and options.logprob_start_len >= 0 else None
        ),
        # Prompt positions before logprob_start_len may then come from the prefix cache.
        "prompt_logprobs_start": max(options.logprob_start_len, 0),
        "logit_bias": logit_bias_from_json(sp.logit_bias),
        "structured_outputs": _structured(sp),
    }
    optional = {
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k,
        "min_p": sp.min_p,
        "presence_penalty": sp.presence_penalty,
        "frequency_penalty": sp.frequency_penalty,
        "repetition_penalty": sp.repetition_penalty,
        "skip_special_tokens": sp.skip_special_tokens,
        "spaces_between_special_tokens": sp.spaces_between_special_tokens,
    }
    values.update({name: value for name, value in optional.items() if value is not None})
    try:
        return SamplingParams.from_dict(values)
    except ValueError as exc:
        message, param = _native_message(exc)
        raise bad_request(message, param=param) from None


def _options(body: GenerateRequest, count: int) -> list[LogprobOptions]:
    returns = _per_prompt(body.return_logprob, count, "return_logprob")
    starts = _per_prompt(body.logprob_start_len, count, "logprob_start_len")
    tops = _per_prompt(body.top_logprobs_num, count, "top_logprobs_num")
    options = []
    for ret, start, top in zip(returns, starts, tops):
        top = 0 if top is None else top
        if not 0 <= top <= SamplingParams.MAX_LOGPROBS:
            raise bad_request(
                f"top_logprobs_num must be in [0, {SamplingParams.MAX_LOGPROBS}], got {top}",
                param="top_logprobs_num",
            )
        start = -1 if start is None else start
        if start < -1:
            raise bad_request(f"logprob_start_len must be >= -1, got {start}", param="logprob_start_len")
        options.append(LogprobOptions(bool(ret), start, top, body.return_text_in_logprobs))
    return options


def plan_generate(ctx: ServerContext, body: GenerateRequest) -> GeneratePlan:
    """Resolve a ``/generate`` body into its prompts; every client mistake is a 400 naming the field."""
    unsupported = unsupported_fields_set(body)
    if unsupported:
        raise bad_request(f"{unsupported[0]} is not supported", param=unsupported[0])
    prompts, is_batch, prompt_param = _prompts(ctx, body)
    count = len(prompts)
    raw_params = _per_prompt(body.sampling_params, count, "sampling_params")
    sampling = [sp if sp is not None else NativeSamplingParams() for sp in raw_params]
    n = sampling[0].n or 1
    if any((sp.n or 1) != n for sp in sampling):
        raise bad_request("every prompt of a batch must ask for the same n", param="sampling_params.n")
    options = _options(body, count)
    rids = _rids(body.rid, count, is_batch)
    if len(set(rids)) != len(rids):
        raise bad_request("the rids of a batch must differ", param="rid")
    salts = _per_prompt(body.cache_salt, count, "cache_salt")
    items = []
    for (text, token_ids), sp, option, rid, salt in zip(prompts, sampling, options, rids, salts):
        if option.return_logprob and option.logprob_start_len >= len(token_ids):
            raise bad_request(
                f"logprob_start_len ({option.logprob_start_len}) must be below the prompt's length "
                f"({len(token_ids)} tokens)",
                param="logprob_start_len",
            )
        items.append(GenerateItem(rid, text, token_ids, build_native_params(sp, option), option, salt))
    return GeneratePlan(items, is_batch or n > 1, n, prompt_param)


async def create_generate(body: GenerateRequest, raw: Request, ctx: ServerContext) -> Response:
    ctx.check_alive()
    plan = plan_generate(ctx, body)
    user = request_user(None, raw)
    streams = [
        ctx.engine.generate(
            item.rid, item.token_ids, item.params, prompt=item.text, cache_salt=item.cache_salt, user=user
        )
        for item in plan.items
    ]
    try:
        states = await open_streams(raw, streams)
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as exc:
        raise from_engine_error(exc, plan.prompt_param) from None
    shaper = OutputShaper(ctx.engine.output_processor.token_text, ctx.engine.weight_version)
    if body.stream:
        return SSEResponse(_stream_generate(plan, streams, states, shaper))
    try:
        await finish_streams(raw, streams)
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as exc:
        raise from_engine_error(exc, plan.prompt_param) from None
    outputs = [
        shaper.response(states[i], states[i].samples[j], plan.output_id(i, j), plan.items[i].options)
        for j in range(plan.n)
        for i in range(len(plan.items))
    ]
    return JSONResponse(outputs if plan.is_batch else outputs[0])


async def _stream_generate(
    plan: GeneratePlan,
    streams: list[AsyncGenerator[RequestState, None]],
    states: list[RequestState],
    shaper: OutputShaper,
) -> AsyncGenerator[str, None]:
    # What each output looked like when last sent: an unchanged output sends nothing.
    sent: dict[tuple[int, int], tuple[int, int, str | None]] = {
        (i, j): (0, 0, None) for i in range(len(plan.items)) for j in range(plan.n)
    }

    def chunks(prompt_index: int, state: RequestState) -> list[str]:
        out = []
        for sample in state.samples:
            key = (prompt_index, sample.index)
            mark = (len(sample.token_ids), len(sample.text), sample.finish_reason)
            if sent[key] == mark:
                continue
            sent[key] = mark
            output_id = plan.output_id(prompt_index, sample.index)
            payload = shaper.response(state, sample, output_id, plan.items[prompt_index].options)
            if plan.is_batch:
                payload["index"] = plan.output_index(prompt_index, sample.index)
            out.append(sse(payload))
        return out

    try:
        async for event in follow_streams(states, streams, chunks):
            yield event
    except Exception as exc:
        yield sse(from_engine_error(exc, plan.prompt_param).body())
    finally:
        for stream in streams:
            await stream.aclose()
    yield SSE_DONE
