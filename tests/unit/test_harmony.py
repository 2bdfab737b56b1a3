"""gpt-oss's harmony format: the reasoning parser (analysis channel → reasoning_content, final and
preambles → content) and the tool parser (messages to ``functions.NAME`` → calls), on token strings
split at every character boundary."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.unit.test_chat_output import _fold_deltas
from tokenmill.frontend.chat_output import ChatOutputParser
from tokenmill.frontend.harmony import HarmonyStream
from tokenmill.frontend.reasoning_parsers import HarmonyReasoningParser, get_reasoning_parser
from tokenmill.frontend.tool_parsers import HarmonyToolParser, detect_tool_parser, get_tool_parser

ANALYSIS_THEN_FINAL = (
    "<|channel|>analysis<|message|>User asks 2+2.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>"
)
CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city": "Paris", "note": "<|x|> }"}<|call|>'
)
REASONING_CASES = [
    (ANALYSIS_THEN_FINAL, ("User asks 2+2.", "2 + 2 = 4.")),
    # Whitespace at a body's edges (touching markup) is dropped; inside it is kept.
    (
        "<|channel|>analysis<|message|>\n Think  twice \n<|end|><|start|>assistant<|channel|>final<|message|> Yes. ",
        ("Think  twice", "Yes."),
    ),
    # Text after a terminator with no header is a message on no channel: content.
    (
        "<|channel|>analysis<|message|>A<|end|> stray<|start|>assistant<|channel|>final<|message|>B",
        ("A", "strayB"),
    ),
    # A preamble on the commentary channel is for the user: content.
    (
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>commentary<|message|>"
        "Let me look.<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>",
        ("Think.", "Let me look.Done."),
    ),
    # Cut off while reasoning (max_tokens): everything so far is reasoning.
    ("<|channel|>analysis<|message|>Still thin", ("Still thin", "")),
    # No header at all (a prompt that already opened the final channel): content.
    ("Plain answer.", ("", "Plain answer.")),
    # A missing terminator: the next header still ends the message.
    (
        "<|channel|>analysis<|message|>Hmm<|start|>assistant<|channel|>final<|message|>Yes",
        ("Hmm", "Yes"),
    ),
]


def _splits(text: str) -> list[list[str]]:
    return [[text[:cut], text[cut:]] for cut in range(len(text) + 1)] + [list(text)]


@pytest.mark.parametrize(("text", "expected"), REASONING_CASES)
def test_reasoning_split_is_the_same_for_every_split(text: str, expected: tuple[str, str]) -> None:
    assert HarmonyReasoningParser().parse(text) == expected
    for pieces in _splits(text):
        parser = HarmonyReasoningParser()
        parts = [parser.feed(piece) for piece in pieces] + [parser.finish()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == expected, pieces


def test_tool_call_through_both_parsers_for_every_split() -> None:
    expected_arguments = '{"city": "Paris", "note": "<|x|> }"}'
    for pieces in _splits(CALL):
        parser = ChatOutputParser(tool_parser=HarmonyToolParser(), reasoning_parser=HarmonyReasoningParser())
        deltas: list[dict[str, Any]] = []
        for piece in pieces:
            deltas += parser.feed(piece)
        deltas += parser.finish()
        message = _fold_deltas(deltas)
        assert message.reasoning_content == "Need the weather."
        assert not message.content
        assert message.tool_calls == [("get_weather", expected_arguments)]  # type: ignore[comparison-overlap]
    whole = ChatOutputParser(
        tool_parser=HarmonyToolParser(), reasoning_parser=HarmonyReasoningParser()
    ).parse(CALL)
    assert whole.content is None and whole.reasoning_content == "Need the weather."
    assert json.loads(whole.tool_calls[0].arguments) == {"city": "Paris", "note": "<|x|> }"}


def test_tool_parser_alone_reads_calls_and_content() -> None:
    text = (
        "<|channel|>final<|message|>Checking.<|end|>"
        "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>"
        '<|start|>assistant<|channel|>commentary to=browser.search<|message|>{"q": 1}<|call|>'
        '<|start|>assistant<|channel|>commentary to=functions.lookup<|message|>{"id": 7'
    )
    extracted = HarmonyToolParser().extract(text)
    assert extracted.content == "Checking."
    # The recipient before the channel counts; a built-in tool is not a function call; a call cut
    # off by max_tokens keeps the arguments read so far.
    assert [(c.name, c.arguments) for c in extracted.tool_calls] == [
        ("get_time", "{}"),
        ("lookup", '{"id": 7'),
    ]


def test_stream_events_name_channels_and_recipients() -> None:
    stream = HarmonyStream()
    events = stream.feed(CALL) + stream.finish()
    headers = [(e.channel, e.recipient) for e in events if e.kind == "header"]
    assert headers == [("analysis", None), ("commentary", "functions.get_weather")]
    assert [e.text for e in events if e.kind == "end"] == ["<|end|>", "<|call|>"]


def test_registry_names_and_detection() -> None:
    assert get_reasoning_parser("openai_gptoss") is HarmonyReasoningParser
    assert get_reasoning_parser("gpt_oss") is HarmonyReasoningParser
    assert get_tool_parser("openai") is HarmonyToolParser
    assert detect_tool_parser("{{ '<|start|>assistant<|channel|>final<|message|>' }}") == "openai"
    assert detect_tool_parser(None, ["GptOssForCausalLM"]) == "openai"
