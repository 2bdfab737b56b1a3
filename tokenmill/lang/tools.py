"""The tool loop behind ``gen(..., tools=[...])``.

Each round renders the conversation with the tool definitions through the model's chat template,
generates, and reads the output with the model's tool-call parser (``frontend/tool_parsers``). Calls
run the Python functions; each result (or the exception, as an ``error: ...`` text) goes back as a
``tool`` message and the loop continues, until the model answers without a call or
``max_tool_steps`` rounds have called tools (then one last round runs without tools, for the answer).
"""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokenmill.frontend.tool_parsers import RequiredToolParser, ToolCall, ToolParser, get_tool_parser
from tokenmill.lang.backend import ChatTurns
from tokenmill.lang.expr import Gen
from tokenmill.lang.trace import CallTimer

if TYPE_CHECKING:
    from tokenmill.lang.state import ProgramState

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def tool_schema(function: Callable[..., Any]) -> dict[str, Any]:
    """An OpenAI function tool for a Python function: its name, docstring and typed parameters."""
    hints = typing.get_type_hints(function)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, parameter in inspect.signature(function).parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        hint = typing.get_origin(hints.get(name)) or hints.get(name)
        properties[name] = {"type": _JSON_TYPES[hint]} if hint in _JSON_TYPES else {}
        if parameter.default is parameter.empty:
            required.append(name)
    return {
        "type": "function",
        "function": {
            "name": function.__name__,
            "description": inspect.getdoc(function) or "",
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def required_call_schema(tools: list[dict[str, Any]]) -> str:
    """JSON schema (as text) of a forced call: ``[{"name": one of the tools, "parameters": {...}}]``."""
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool["function"]["name"]]},
                "parameters": tool["function"]["parameters"],
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    return json.dumps({"type": "array", "minItems": 1, "maxItems": 1, "items": {"anyOf": variants}})


def call_tool(functions: dict[str, Callable[..., Any]], call: ToolCall) -> str:
    """Run one call; its result as text (JSON unless a string), or ``error: ...`` when it fails."""
    function = functions.get(call.name)
    if function is None:
        return f"error: there is no tool named {call.name!r}; tools are {', '.join(functions)}"
    try:
        arguments = json.loads(call.arguments) if call.arguments.strip() else {}
        if not isinstance(arguments, dict):
            raise ValueError(f"arguments must be a JSON object, got {call.arguments}")
        result = function(**arguments)
    except Exception as exc:  # the model reads what went wrong and may try again
        return f"error: {type(exc).__name__}: {exc}"
    return result if isinstance(result, str) else json.dumps(result)


def _parser_for(state: ProgramState, gen: Gen, forced: bool) -> ToolParser:
    if forced:
        return RequiredToolParser()
    name = gen.tool_parser or state.backend.tool_parser_name()
    if name is None:
        raise ValueError(
            "gen(tools=...): the model's tool-call format is unknown (its chat template shows none); "
            "pass tool_parser= (e.g. 'hermes') or tool_choice='required'"
        )
    return get_tool_parser(name)()


def _with_tool_instructions(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """For a chat template that ignores ``tools``: describe them (Hermes markup) in the system turn."""
    text = (
        "You can call these functions:\n"
        + "\n".join(json.dumps(tool["function"]) for tool in tools)
        + '\nTo call one, answer with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
    )
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def run_tool_loop(state: ProgramState, gen: Gen) -> None:
    """Run ``gen``'s tool loop in ``state``: it must be an empty open assistant block.

    Afterwards the state's text is the last round's rendered prompt plus the answer, its messages
    hold the assistant calls and tool results, and ``state[gen.name]`` is the answer; the meta info
    lists every call with its result.
    """
    messages = state._messages
    if state._open_role != "assistant" or messages[-1]["content"]:
        raise ValueError(
            "gen(tools=...) must be the first thing in an assistant block: s += assistant(gen(...))"
        )
    assert gen.tools is not None
    functions = {function.__name__: function for function in gen.tools}
    tools = [tool_schema(function) for function in gen.tools]
    conversation = [dict(m) for m in messages[:-1]]
    source = state.backend.chat_template_source()
    shows_tools = source is None or "tools" in source
    calls_made: list[dict[str, Any]] = []
    plain = Gen(**{**gen.__dict__, "tools": None})
    answer, prompt = "", ""
    for round_index in range(gen.max_tool_steps + 1):
        last = round_index == gen.max_tool_steps
        forced = gen.tool_choice == "required" and round_index == 0
        turn_messages = conversation if shows_tools or last else _with_tool_instructions(conversation, tools)
        prompt = state.backend.render_chat(ChatTurns(turn_messages, [] if last else tools))
        params = Gen(**{**plain.__dict__, "json_schema": required_call_schema(tools)}) if forced else plain
        with CallTimer(state.trace, state.lane, "tool" if not last else "gen", gen.name) as timer:
            result = state.backend.generate(prompt, params)
            timer.counts(result.prompt_tokens, result.completion_tokens, result.cached_tokens)
        if last:
            answer = result.text
            break
        extracted = _parser_for(state, gen, forced).extract(result.text)
        if not extracted.tool_calls:
            answer = extracted.content
            break
        conversation.append(
            {
                "role": "assistant",
                "content": extracted.content,
                "tool_calls": [_template_call(call) for call in extracted.tool_calls],
            }
        )
        for call in extracted.tool_calls:
            output = call_tool(functions, call)
            calls_made.append({"name": call.name, "arguments": call.arguments, "result": output})
            conversation.append(
                {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": output}
            )
    with state._cond:
        state._text = prompt
        state._messages[:] = [*conversation, {"role": "assistant", "content": ""}]
    state._commit_text(answer, gen.name, streamed="")
    state._set_var(gen.name, answer, {"tool_calls": calls_made})


def _template_call(call: ToolCall) -> dict[str, Any]:
    """A call as chat templates expect it: arguments as an object, not JSON text."""
    try:
        arguments: Any = json.loads(call.arguments) if call.arguments.strip() else {}
    except ValueError:
        arguments = call.arguments
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}
