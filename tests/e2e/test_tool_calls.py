"""Tool calls and reasoning through a real server and the official ``openai`` client.

The scripted model (``scripted_model.py``) writes Hermes-style ``<tool_call>`` markup and
``<think>`` blocks on cue, so the server's parsers (``--tool-call-parser hermes --reasoning-parser
qwen3``) run on real engine output, streamed token by token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from scripted_model import build_scripted_model
from server_process import TINY_ARGS, ServerProcess

SCRIPTS = {
    "weather?": [
        "Let",
        "me",
        "check.",
        "<tool_call>",
        '{"name": "get_weather",',
        '"arguments": {"city": "Paris",',
        '"unit": "celsius"}}',
        "</tool_call>",
        "<tool_call>\n",
        '{"name": "get_time",',
        '"arguments": {"tz": "Europe/Paris"}}',
        "</tool_call>\n",
    ],
    "think?": [
        "<think>",
        "The",
        "user",
        "wants",
        "Rome.",
        "</think>",
        "<tool_call>\t",
        '{"name":',
        '"get_weather",\t',
        '"arguments":',
        '{"city":',
        '"Rome"}}',
        "</tool_call>\t",
    ],
    "unicode?": [
        "Voilà:",
        '<tool_call>{"name": "translate",',
        '"arguments": {"text": "東京 👋 \\"hi\\" }"}}</tool_call>',
    ],
    "long?": [
        "<tool_call>\n\n",
        '{"name": "get_weather",\n',
        '"arguments":  {"city":',
        '"Lyon",',
        '"days": 3}}',
    ],
    "hello?": ["Hello", "there!"],
    "after_tool": ["Sunny", "in", "Paris."],
}
WEATHER_CALLS = [
    ("get_weather", '{"city": "Paris", "unit": "celsius"}'),
    ("get_time", '{"tz": "Europe/Paris"}'),
]
MARKUP = ("<tool_call>", "</tool_call>", "<think>", "</think>")


def _tool(name: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} tool",
            "parameters": {"type": "object", "properties": properties, "required": list(properties)},
        },
    }


TOOLS = [
    _tool("get_weather", {"city": {"type": "string"}, "unit": {"type": "string"}}),
    _tool("get_time", {"tz": {"type": "string"}}),
    _tool("translate", {"text": {"type": "string"}}),
]


@pytest.fixture(scope="module")
def scripted_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = str(tmp_path_factory.mktemp("scripted-model"))
    build_scripted_model(path, SCRIPTS)
    args = [
        *TINY_ARGS,
        "--served-model-name",
        "scripted",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
    ]
    server = ServerProcess(path, args)
    yield server
    server.stop()


def _ask(cue: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"please answer {cue}"}]


def _create(server: ServerProcess, cue: str, **kwargs: Any) -> Any:
    kwargs.setdefault("tools", TOOLS)
    kwargs.setdefault("max_tokens", 40)
    return server.client().chat.completions.create(model="scripted", messages=_ask(cue), **kwargs)  # type: ignore[arg-type]


def _collect(server: ServerProcess, cue: str, **kwargs: Any) -> dict[str, Any]:
    """Stream a completion and fold its chunks per choice, checking OpenAI's delta rules on the way."""
    kwargs.setdefault("tools", TOOLS)
    kwargs.setdefault("max_tokens", 40)
    stream = server.client().chat.completions.create(
        model="scripted",
        messages=_ask(cue),
        stream=True,
        stream_options={"include_usage": True},
        **kwargs,
    )  # type: ignore[arg-type]
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            assert not chunk.choices
            usage = chunk.usage
        for choice in chunk.choices:
            state = choices.setdefault(
                choice.index, {"content": "", "reasoning": "", "calls": [], "finish": None, "kinds": []}
            )
            assert state["finish"] is None, "nothing may follow the finish chunk"
            delta = choice.delta
            if delta.content:
                state["content"] += delta.content
                state["kinds"].append("content")
            reasoning = (delta.model_extra or {}).get("reasoning_content")
            if reasoning:
                state["reasoning"] += reasoning
                state["kinds"].append("reasoning")
            for call in delta.tool_calls or []:
                state["kinds"].append("tool_calls")
                if call.id is not None:  # a call's first delta: index, id, type, name and empty arguments
                    assert call.index == len(state["calls"])
                    assert call.type == "function" and call.function.name and call.function.arguments == ""
                    state["calls"].append({"id": call.id, "name": call.function.name, "arguments": ""})
                else:
                    assert call.function.name is None
                    state["calls"][call.index]["arguments"] += call.function.arguments
            if choice.finish_reason is not None:
                state["finish"] = choice.finish_reason
    return {"choices": choices, "usage": usage}


def test_auto_tool_calls_non_streaming(scripted_server: ServerProcess) -> None:
    response = _create(scripted_server, "weather?")
    [choice] = response.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    calls = choice.message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == WEATHER_CALLS
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls)
    assert len({c.id for c in calls}) == 2
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert response.usage.completion_tokens == len(SCRIPTS["weather?"]) + 1  # the script and EOS


def test_auto_tool_calls_streaming_equal_non_streaming(scripted_server: ServerProcess) -> None:
    folded = _collect(scripted_server, "weather?")
    state = folded["choices"][0]
    assert state["content"] == "Let me check."
    assert [(c["name"], c["arguments"]) for c in state["calls"]] == WEATHER_CALLS
    assert all(c["id"].startswith("call_") for c in state["calls"])
    assert state["finish"] == "tool_calls"
    assert folded["usage"].completion_tokens == len(SCRIPTS["weather?"]) + 1


def test_each_choice_has_its_own_parser(scripted_server: ServerProcess) -> None:
    folded = _collect(scripted_server, "weather?", n=3)
    assert sorted(folded["choices"]) == [0, 1, 2]
    ids = set()
    for state in folded["choices"].values():
        assert state["content"] == "Let me check." and state["finish"] == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in state["calls"]] == WEATHER_CALLS
        ids |= {c["id"] for c in state["calls"]}
    assert len(ids) == 6
    assert folded["usage"].completion_tokens == 3 * (len(SCRIPTS["weather?"]) + 1)


def test_parallel_tool_calls_false_returns_the_first_call(scripted_server: ServerProcess) -> None:
    response = _create(scripted_server, "weather?", parallel_tool_calls=False)
    assert [
        (c.function.name, c.function.arguments) for c in response.choices[0].message.tool_calls
    ] == WEATHER_CALLS[:1]
    state = _collect(scripted_server, "weather?", parallel_tool_calls=False)["choices"][0]
    assert [(c["name"], c["arguments"]) for c in state["calls"]] == WEATHER_CALLS[:1]


def test_reasoning_then_tool_call(scripted_server: ServerProcess) -> None:
    response = _create(scripted_server, "think?")
    message = response.choices[0].message
    assert message.model_extra["reasoning_content"] == "The user wants Rome."
    assert message.content is None
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("get_weather", '{"city": "Rome"}')
    ]
    state = _collect(scripted_server, "think?")["choices"][0]
    assert state["reasoning"] == "The user wants Rome." and state["content"] == ""
    assert [(c["name"], c["arguments"]) for c in state["calls"]] == [("get_weather", '{"city": "Rome"}')]
    first_call = state["kinds"].index("tool_calls")
    assert (
        set(state["kinds"][:first_call]) == {"reasoning"} and "reasoning" not in state["kinds"][first_call:]
    )
    assert state["finish"] == "tool_calls"


def test_unicode_and_escaped_arguments(scripted_server: ServerProcess) -> None:
    response = _create(scripted_server, "unicode?")
    message = response.choices[0].message
    assert message.content == "Voilà:"
    [call] = message.tool_calls
    assert json.loads(call.function.arguments) == {"text": '東京 👋 "hi" }'}
    state = _collect(scripted_server, "unicode?")["choices"][0]
    assert state["content"] == "Voilà:" and state["calls"][0]["arguments"] == call.function.arguments


def test_call_cut_by_max_tokens_keeps_what_was_read(scripted_server: ServerProcess) -> None:
    response = _create(scripted_server, "long?", max_tokens=4)
    [choice] = response.choices
    assert choice.finish_reason == "length"  # as OpenAI: the call is returned, truncated, with "length"
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city": "Lyon",')
    ]
    assert choice.message.content is None
    state = _collect(scripted_server, "long?", max_tokens=4)["choices"][0]
    assert state["finish"] == "length" and state["calls"][0]["arguments"] == '{"city": "Lyon",'


def test_plain_answer_with_tools_offered(scripted_server: ServerProcess) -> None:
    response = _create(scripted_server, "hello?")
    [choice] = response.choices
    assert choice.message.content == "Hello there!" and not choice.message.tool_calls
    assert choice.finish_reason == "stop"
    state = _collect(scripted_server, "hello?")["choices"][0]
    assert state["content"] == "Hello there!" and state["calls"] == [] and state["finish"] == "stop"


def test_tool_choice_none_hides_tools_and_parses_nothing(scripted_server: ServerProcess) -> None:
    offered = _create(scripted_server, "weather?")
    hidden = _create(scripted_server, "weather?", tool_choice="none")
    # The template writes "tool NAME" per offered tool: two tokens each.
    assert offered.usage.prompt_tokens - hidden.usage.prompt_tokens == 2 * len(TOOLS)
    [choice] = hidden.choices
    assert not choice.message.tool_calls and choice.finish_reason == "stop"
    assert choice.message.content == " ".join(SCRIPTS["weather?"])


def test_history_with_tool_calls_and_results_renders(scripted_server: ServerProcess) -> None:
    arguments = '{"city": "Paris"}'
    messages = [
        {"role": "user", "content": "weather in Paris"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": "after_tool"},
    ]
    response = scripted_server.client().chat.completions.create(
        model="scripted",
        messages=messages,
        tools=TOOLS,
        max_tokens=20,  # type: ignore[arg-type]
    )
    assert response.choices[0].message.content == "Sunny in Paris."
    # tools (2 words each) + "weather in Paris" + "call get_weather Paris" (arguments decoded for the
    # template, so .city renders) + "result call_abc after_tool"
    assert response.usage.prompt_tokens == 2 * len(TOOLS) + 3 + 3 + 3


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "launch"}}},
            "tool_choice names the function 'launch', which is not among the tools",
        ),
        ({"tools": None, "tool_choice": "auto"}, "tool_choice is only allowed when tools are given"),
        ({"tool_choice": "sometimes"}, "tool_choice must be 'none', 'auto', 'required' or a function"),
        (
            {"tools": [{"type": "function", "function": {"name": "has space"}}]},
            "tools.0.function.name must be",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{x"}}],
                    }
                ]
            },
            "messages.0.tool_calls.0.function.arguments is not valid JSON",
        ),
    ],
)
def test_bad_tool_requests_are_400(
    scripted_server: ServerProcess, extra: dict[str, Any], message: str
) -> None:
    body: dict[str, Any] = {"model": "scripted", "messages": _ask("hello?"), "tools": TOOLS, **extra}
    body = {k: v for k, v in body.items() if v is not None}
    with scripted_server.http() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    with scripted_server.http() as http:  # and the server keeps serving
        assert (
            http.post(
                "/v1/chat/completions", json={"model": "scripted", "messages": _ask("hello?")}
            ).status_code
            == 200
        )


def test_auto_without_a_known_format_is_400(tiny_server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError, match="start the server with --tool-call-parser"):
        tiny_server.client().chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "<5>"}],
            tools=TOOLS,  # type: ignore[arg-type]
        )


def test_logprobs_survive_parsing(scripted_server: ServerProcess) -> None:
    # Parsers hold text back while markup is undecided; every token's logprob still goes out once.
    stream = scripted_server.client().chat.completions.create(
        model="scripted",
        messages=_ask("weather?"),  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=40,
        logprobs=True,
        top_logprobs=1,
        stream=True,
    )
    tokens = [
        entry.token
        for chunk in stream
        for c in chunk.choices
        if c.logprobs
        for entry in c.logprobs.content or []
    ]
    assert tokens == [*SCRIPTS["weather?"], "</s>"]
