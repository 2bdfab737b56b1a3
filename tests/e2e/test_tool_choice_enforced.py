"""``tool_choice`` "required" and a named function on SmolLM2: a grammar makes every answer a call.

SmolLM2-135M has no tool-call format of its own; the JSON-schema grammar (see
``server/serving_tools.py``) is what makes its output a call, so these tests check that whatever it
writes parses, matches the tools' schemas, and streams to the same calls as the non-streamed answer
(greedy, so both runs generate the same tokens). LangChain's ``bind_tools`` is the client that
real agents use.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from server_process import ServerProcess

CITIES = ["Paris", "Rome", "Tokyo"]
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": CITIES},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "JST"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


def _check_call(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "get_weather":
        assert args["city"] in CITIES and args["unit"] in ("celsius", "fahrenheit") and len(args) == 2
    else:
        assert name == "get_time" and set(args) == {"zone"}


def _both_ways(server: ServerProcess, **kwargs: Any) -> list[tuple[str, str]]:
    """The calls of one greedy answer, non-streamed and streamed (asserted equal)."""
    client = server.client()
    body: dict[str, Any] = {"model": "smollm2-135m", "messages": MESSAGES, "tools": TOOLS, "temperature": 0}
    body.update(max_tokens=120, **kwargs)
    response = client.chat.completions.create(**body)
    [choice] = response.choices
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)

    streamed: list[dict[str, str]] = []
    finish = None
    for chunk in client.chat.completions.create(**body, stream=True):
        for delta_choice in chunk.choices:
            assert not delta_choice.delta.content
            for call in delta_choice.delta.tool_calls or []:
                if call.id is not None:
                    assert call.function.arguments == "" and call.index == len(streamed)
                    streamed.append({"name": call.function.name, "arguments": ""})
                else:
                    streamed[call.index]["arguments"] += call.function.arguments
            finish = delta_choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed] == calls
    for name, arguments in calls:
        _check_call(name, arguments)
    return calls


def test_required_always_parses(smollm_server: ServerProcess) -> None:
    # Without parallel calls the schema caps the array at one call (the uncapped schema is unit-tested).
    assert len(_both_ways(smollm_server, tool_choice="required", parallel_tool_calls=False)) == 1


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_named_function_always_parses(smollm_server: ServerProcess, name: str) -> None:
    calls = _both_ways(smollm_server, tool_choice={"type": "function", "function": {"name": name}})
    assert [call_name for call_name, _ in calls] == [name]


def test_forced_choice_with_another_constraint_is_400(smollm_server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError, match="cannot be combined with another output constraint"):
        smollm_server.client().chat.completions.create(
            model="smollm2-135m",
            messages=MESSAGES,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice="required",
            response_format={"type": "json_object"},
        )


def test_langchain_bind_tools(smollm_server: ServerProcess) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        base_url=smollm_server.url, api_key="unused", model="smollm2-135m", temperature=0, max_tokens=120
    )
    required = llm.bind_tools(TOOLS, tool_choice="required").invoke("What is the weather like in Paris?")
    assert required.tool_calls, required
    for call in required.tool_calls:
        assert call["name"] in ("get_weather", "get_time") and call["id"].startswith("call_")
        _check_call(call["name"], json.dumps(call["args"]))
    named = llm.bind_tools(TOOLS, tool_choice="get_time").invoke("What time is it in Tokyo?")
    assert [call["name"] for call in named.tool_calls] == ["get_time"]
    _check_call("get_time", json.dumps(named.tool_calls[0]["args"]))
    streamed = None
    for piece in llm.bind_tools(TOOLS, tool_choice="get_time").stream("What time is it in Tokyo?"):
        streamed = piece if streamed is None else streamed + piece
    assert streamed is not None and streamed.tool_calls[0]["args"] == named.tool_calls[0]["args"]
