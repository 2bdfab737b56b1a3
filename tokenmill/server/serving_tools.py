"""Tool calling and reasoning for ``/v1/chat/completions``.

``plan_chat_tools`` validates ``tools``/``tool_choice``/``parallel_tool_calls`` and decides how calls
are produced:

- ``none`` (or no tools): tools are not shown to the model and nothing is parsed as a call.
- ``auto``: tools go to the chat template and the model's output is read by the format's parser
  (``--tool-call-parser``, else detected from the chat template or architecture; a model whose format
  is unknown gets a 400 rather than calls silently left in the content).
- ``required`` and a named function: a JSON-schema grammar (``SamplingParams.structured_outputs``)
  makes the output a call by construction, as vLLM does. Named: the schema is the function's
  ``parameters`` and the output is the arguments. Required: an array of ``{"name", "parameters"}``
  objects (at most one unless parallel calls are allowed). The JSON is then read into calls.

``ChoiceOutput`` wraps one choice's ``ChatOutputParser`` (tool calls plus ``--reasoning-parser``)
with what the serving code needs: the message, stream deltas and the finish reason (``tool_calls``
when a call was made and the model stopped by itself).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenmill.frontend.chat_output import ChatMessageParts, ChatOutputParser
from tokenmill.frontend.output_processor import SampleState
from tokenmill.frontend.reasoning_parsers import (
    ThinkReasoningParser,
    get_reasoning_parser,
    prompt_opens_reasoning,
)
from tokenmill.frontend.tool_parsers import (
    TOOL_PARSERS,
    NamedToolParser,
    RequiredToolParser,
    ToolParser,
    detect_tool_parser,
    get_tool_parser,
)
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.server.context import ServerContext
from tokenmill.server.errors import bad_request
from tokenmill.server.openai_protocol import ChatCompletionRequest

_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_\-]{1,64}")
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def validate_tools(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The function definitions of ``tools`` by name; 400 naming the entry that is malformed."""
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise bad_request(
                f"tools.{i}: only function tools are supported: "
                "{'type': 'function', 'function': {'name': ..., 'parameters': {...}}}",
                param=f"tools.{i}",
            )
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
            raise bad_request(
                f"tools.{i}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                param=f"tools.{i}.function.name",
            )
        if name in functions:
            raise bad_request(f"tools.{i}: the function name {name!r} is used twice", param=f"tools.{i}")
        parameters = function.get("parameters", _ANY_OBJECT)
        if not isinstance(parameters, dict):
            raise bad_request(
                f"tools.{i}.function.parameters must be a JSON schema object",
                param=f"tools.{i}.function.parameters",
            )
        functions[name] = function
    return functions


def template_tool_calls(tool_calls: list[dict[str, Any]], param: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as chat templates expect them: arguments as a dict.

    OpenAI sends ``function.arguments`` as a JSON string; templates (Qwen, Llama, Mistral) write it
    with ``tojson``, which would encode the string a second time.
    """
    result = []
    for j, call in enumerate(tool_calls):
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"{param}.{j}: a tool call needs function.name", param=f"{param}.{j}")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise bad_request(
                    f"{param}.{j}.function.arguments is not valid JSON",
                    param=f"{param}.{j}.function.arguments",
                ) from None
        result.append({**call, "function": {**function, "arguments": arguments}})
    return result


def required_schema(functions: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The schema of ``tool_choice: "required"`` output: a non-empty array of calls to known functions."""
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [name]},
                "parameters": function.get("parameters", _ANY_OBJECT),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, function in functions.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _choice_name(tool_choice: Any) -> str | None:
    """The function named by a ``{"type": "function", "function": {"name": ...}}`` choice (400 otherwise)."""
    function = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise bad_request(
            "tool_choice must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    return name


@dataclass
class ChatToolPlan:
    """How one chat request's tools are offered, enforced and parsed."""

    template_tools: list[dict[str, Any]] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    make_tool_parser: Callable[[], ToolParser] | None = None
    max_tool_calls: int | None = None
    keep_special_tokens: bool = False
    reasoning_parser: type[ThinkReasoningParser] | None = None
    stop_token_ids: list[int] = field(default_factory=list)  # the tool format's stop markers

    def apply(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the grammar and detokenization this plan needs; 400 on a clashing constraint."""
        changes: dict[str, Any] = {}
        if self.structured_outputs is not None:
            if params.structured_outputs is not None:
                raise bad_request(
                    "tool_choice 'required' or a named function cannot be combined with another output "
                    "constraint (response_format, guided_*)",
                    param="tool_choice",
                )
            changes["structured_outputs"] = self.structured_outputs
        stops = list(params.stop_token_ids or [])
        missing_stops = [t for t in self.stop_token_ids if t not in stops]
        if missing_stops:
            changes["stop_token_ids"] = stops + missing_stops
        if self.keep_special_tokens:
            # The format's markers are special tokens: keep them, and nothing between them.
            changes["skip_special_tokens"] = False
            changes["spaces_between_special_tokens"] = False
        return params.clone(**changes) if changes else params

    def choice_outputs(self, ctx: ServerContext, prompt_text: str, n: int) -> list[ChoiceOutput] | None:
        """One output reader per choice, or None when the text goes out untouched."""
        if self.make_tool_parser is None and self.reasoning_parser is None:
            return None
        opened = prompt_opens_reasoning(prompt_text)
        eos_texts = _eos_texts(ctx) if self.keep_special_tokens else {}
        outputs = []
        for _ in range(n):
            parser = ChatOutputParser(
                tool_parser=self.make_tool_parser() if self.make_tool_parser is not None else None,
                reasoning_parser=self.reasoning_parser(opened) if self.reasoning_parser is not None else None,
                max_tool_calls=self.max_tool_calls,
            )
            outputs.append(ChoiceOutput(parser, eos_texts))
        return outputs


def plan_chat_tools(body: ChatCompletionRequest, ctx: ServerContext) -> ChatToolPlan:
    """Validate the request's tool fields and decide how calls are made (see the module docstring)."""
    reasoning = ctx.settings.reasoning_parser
    plan = ChatToolPlan(reasoning_parser=get_reasoning_parser(reasoning) if reasoning else None)
    if plan.reasoning_parser is not None and plan.reasoning_parser.special_markers:
        # Harmony's channel markers are special tokens: the parser must see them in the text.
        plan.keep_special_tokens = _markers_are_special(ctx, plan.reasoning_parser.special_markers)
    if not body.tools:
        if body.tool_choice is not None:
            raise bad_request("tool_choice is only allowed when tools are given", param="tool_choice")
        return plan
    functions = validate_tools(body.tools)
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    parallel = body.parallel_tool_calls is not False
    plan.max_tool_calls = None if parallel else 1
    if choice == "none":
        return plan
    plan.template_tools = body.tools
    if choice == "auto":
        name = _auto_parser_name(ctx, body.chat_template)
        parser_cls = get_tool_parser(name)
        plan.make_tool_parser = parser_cls
        plan.keep_special_tokens |= _markers_are_special(ctx, parser_cls.special_markers)
        plan.stop_token_ids = _special_token_ids(ctx, parser_cls.stop_markers)
        return plan
    if choice == "required":
        schema = required_schema(functions, parallel)
        plan.make_tool_parser = RequiredToolParser
    elif isinstance(choice, dict):
        function_name = _choice_name(choice)
        if function_name not in functions:
            raise bad_request(
                f"tool_choice names the function {function_name!r}, which is not among the tools "
                f"({', '.join(functions)})",
                param="tool_choice",
            )
        schema = functions[function_name].get("parameters", _ANY_OBJECT)
        plan.make_tool_parser = lambda: NamedToolParser(function_name)
    else:
        raise bad_request(
            f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}",
            param="tool_choice",
        )
    plan.structured_outputs = StructuredOutputsParams(json=json.dumps(schema))
    # The grammar makes the output JSON from its first token: there is no reasoning to split off, and
    # a prompt that opened <think> must not turn the call into reasoning.
    plan.reasoning_parser = None
    plan.keep_special_tokens = False
    return plan


def _auto_parser_name(ctx: ServerContext, request_template: str | None) -> str:
    if ctx.settings.tool_call_parser:
        return ctx.settings.tool_call_parser
    template = request_template or getattr(ctx.engine.tokenizer, "chat_template", None)
    architectures = getattr(ctx.engine.source.hf_config, "architectures", None) or []
    name = detect_tool_parser(template if isinstance(template, str) else None, architectures)
    if name is None:
        raise bad_request(
            "tool_choice 'auto' needs a tool-call parser, and this model's format could not be detected; "
            f"start the server with --tool-call-parser (one of {', '.join(sorted(TOOL_PARSERS))}) "
            "or use tool_choice 'required' or a named function",
            param="tool_choice",
        )
    return name


def _markers_are_special(ctx: ServerContext, markers: tuple[str, ...]) -> bool:
    tokenizer = ctx.engine.tokenizer
    special = {str(token) for token in getattr(tokenizer, "all_special_tokens", [])}
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special |= {str(token) for token in added.values() if getattr(token, "special", False)}
    return any(marker in special for marker in markers)


def _special_token_ids(ctx: ServerContext, markers: tuple[str, ...]) -> list[int]:
    """The ids of those ``markers`` that are single special tokens of the model's tokenizer."""
    tokenizer = ctx.engine.tokenizer
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = {str(token): token_id for token_id, token in added.items() if getattr(token, "special", False)}
    return [special[marker] for marker in markers if marker in special]


def _eos_texts(ctx: ServerContext) -> dict[int, str]:
    tokenizer = ctx.engine.tokenizer
    return {
        token: str(tokenizer.decode([token], skip_special_tokens=False))
        for token in ctx.engine.input_processor.eos_token_ids
    }


class ChoiceOutput:
    """One choice's reader: feeds its text to the parsers and answers the OpenAI-facing questions."""

    def __init__(self, parser: ChatOutputParser, eos_texts: dict[int, str]) -> None:
        self.parser = parser
        self.eos_texts = eos_texts  # set when special tokens are kept: the EOS text is not content

    def _visible(self, sample: SampleState, text: str) -> str:
        if self.eos_texts and sample.finish_reason is not None and sample.token_ids:
            eos = self.eos_texts.get(sample.token_ids[-1])
            if eos:
                return text.removesuffix(eos)
        return text

    def message(self, sample: SampleState) -> ChatMessageParts:
        """The finished sample's message."""
        return self.parser.parse(self._visible(sample, sample.text))

    def deltas(self, sample: SampleState, text: str, finishing: bool) -> list[dict[str, Any]]:
        """Stream deltas for ``text``, new since the last call; ``finishing`` on the sample's last call."""
        if finishing:
            text = self._visible(sample, text)
        deltas = self.parser.feed(text) if text else []
        if finishing:
            deltas += self.parser.finish()
        return deltas

    def finish_reason(self, sample: SampleState) -> str | None:
        if sample.finish_reason == "stop" and self.parser.made_tool_calls:
            return "tool_calls"
        return sample.finish_reason
