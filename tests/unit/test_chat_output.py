"""Reasoning parsers and the per-choice chat output parser (reasoning + tool calls → OpenAI deltas)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenmill.frontend.chat_output import ChatMessageParts, ChatOutputParser
from tokenmill.frontend.reasoning_parsers import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ThinkReasoningParser,
    get_reasoning_parser,
    prompt_opens_reasoning,
)
from tokenmill.frontend.tool_parsers import HermesToolParser
from tokenmill.server.serving_tools import required_schema, template_tool_calls, validate_tools

REASONING_CASES: list[tuple[type[ThinkReasoningParser], bool, str, tuple[str, str]]] = [
    (
        Qwen3ReasoningParser,
        False,
        "<think>\nLet me think. </thi\n</think>\n\nHello!",
        ("Let me think. </thi", "Hello!"),
    ),
    (
        Qwen3ReasoningParser,
        False,
        "Hello <think>not reasoning</think>",
        ("", "Hello <think>not reasoning</think>"),
    ),
    (Qwen3ReasoningParser, False, "  <thin", ("", "  <thin")),
    (Qwen3ReasoningParser, True, "\nstill thinking</think>\n\nAnswer", ("still thinking", "Answer")),
    (Qwen3ReasoningParser, True, "cut off while thinking ", ("cut off while thinking ", "")),
    (DeepSeekR1ReasoningParser, False, "no opening tag</think>Answer", ("no opening tag", "Answer")),
    (DeepSeekR1ReasoningParser, False, "<think>tagged</think> Answer", ("tagged", "Answer")),
    (DeepSeekR1ReasoningParser, False, "never closed", ("never closed", "")),
]


@pytest.mark.parametrize(("cls", "opened", "text", "expected"), REASONING_CASES)
def test_reasoning_split_is_the_same_for_every_split(
    cls: type[ThinkReasoningParser], opened: bool, text: str, expected: tuple[str, str]
) -> None:
    assert cls(prompt_opened=opened).parse(text) == expected
    for pieces in [[text[:cut], text[cut:]] for cut in range(len(text) + 1)] + [list(text)]:
        parser = cls(prompt_opened=opened)
        parts = [parser.feed(piece) for piece in pieces] + [parser.finish()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == expected, pieces


def test_reasoning_registry_and_prompt_detection() -> None:
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    with pytest.raises(
        ValueError,
        match="unknown reasoning parser 'o1'; known parsers: deepseek_r1, gpt_oss, openai_gptoss, qwen3",
    ):
        get_reasoning_parser("o1")
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


THINK_AND_CALL = (
    '<think>I could write <tool_call>{"name": "x"}</tool_call> here.</think>\n\n'
    "Checking.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Z\\u00fcrich \\"old\\" }"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def _fold_deltas(deltas: list[dict[str, Any]]) -> ChatMessageParts:
    reasoning, content = "", ""
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        assert len(delta) == 1, delta  # one kind of thing per delta
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["index"] == len(calls) and call["type"] == "function"
                assert call["function"]["arguments"] == ""
                calls.append({"id": call["id"], "name": call["function"]["name"], "arguments": ""})
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                calls[call["index"]]["arguments"] += call["function"]["arguments"]
    return ChatMessageParts(
        content or None,
        reasoning or None,
        [(c["name"], c["arguments"]) for c in calls],  # type: ignore[misc]
    )


def _parser(max_tool_calls: int | None = None) -> ChatOutputParser:
    return ChatOutputParser(HermesToolParser(), Qwen3ReasoningParser(), max_tool_calls)


def test_reasoning_then_tool_calls_streamed_like_openai() -> None:
    whole = _parser().parse(THINK_AND_CALL)
    assert whole.reasoning_content == 'I could write <tool_call>{"name": "x"}</tool_call> here.'
    assert whole.content == "Checking."
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [
        ("get_weather", '{"city": "Z\\u00fcrich \\"old\\" }"}'),
        ("get_time", "{}"),
    ]
    assert json.loads(whole.tool_calls[0].arguments) == {"city": 'Zürich "old" }'}
    for pieces in [[THINK_AND_CALL[:cut], THINK_AND_CALL[cut:]] for cut in range(len(THINK_AND_CALL))]:
        parser = _parser()
        deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.finish()
        kinds = [next(iter(d)) for d in deltas]
        # Reasoning first, then the answer; never reasoning after the answer began.
        assert (
            kinds.index("reasoning_content") == 0
            and "reasoning_content" not in kinds[kinds.index("content") :]
        )
        folded = _fold_deltas(deltas)
        assert folded.reasoning_content == whole.reasoning_content and folded.content == whole.content
        assert folded.tool_calls == [(c.name, c.arguments) for c in whole.tool_calls]  # type: ignore[comparison-overlap]
        assert parser.made_tool_calls


def test_parallel_tool_calls_false_keeps_only_the_first_call() -> None:
    whole = _parser(max_tool_calls=1).parse(THINK_AND_CALL)
    assert [c.name for c in whole.tool_calls] == ["get_weather"]
    parser = _parser(max_tool_calls=1)
    deltas = [d for ch in THINK_AND_CALL for d in parser.feed(ch)] + parser.finish()
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", []) if "id" in c] == [
        "get_weather"
    ]


def test_content_is_none_only_beside_calls_or_reasoning() -> None:
    assert ChatOutputParser(HermesToolParser()).parse("").content == ""
    assert ChatOutputParser(HermesToolParser()).parse('<tool_call>{"name": "f"}</tool_call>').content is None
    assert ChatOutputParser(None, Qwen3ReasoningParser()).parse("<think>hm</think>").content is None
    assert ChatOutputParser().parse("as is ").content == "as is "


def test_required_schema_and_tool_validation() -> None:
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "now"}},
    ]
    functions = validate_tools(tools)
    schema = required_schema(functions, parallel=False)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [v["properties"]["name"]["enum"] for v in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["now"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}
    assert "maxItems" not in required_schema(functions, parallel=True)


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ([{"type": "code_interpreter"}], "tools.0: only function tools are supported"),
        ([{"type": "function", "function": {"name": "a b"}}], "tools.0.function.name must be 1-64 letters"),
        (
            [
                {"type": "function", "function": {"name": "f"}},
                {"type": "function", "function": {"name": "f"}},
            ],
            "tools.1: the function name 'f' is used twice",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
            "tools.0.function.parameters must be a JSON schema object",
        ),
    ],
)
def test_bad_tools_are_named(tools: list[dict[str, Any]], message: str) -> None:
    from tokenmill.server.errors import APIError

    with pytest.raises(APIError, match=message) as info:
        validate_tools(tools)
    assert info.value.status == 400


def test_history_tool_calls_get_decoded_arguments_for_templates() -> None:
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    assert template_tool_calls(calls, "messages.1.tool_calls")[0]["function"]["arguments"] == {"a": 1}
    from tokenmill.server.errors import APIError

    bad = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]
    with pytest.raises(APIError, match=r"messages.1.tool_calls.0.function.arguments is not valid JSON"):
        template_tool_calls(bad, "messages.1.tool_calls")
