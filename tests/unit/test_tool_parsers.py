"""Tool-call parsers: non-streaming results, and streamed deltas equal to them for every split.

Each case is parsed whole (``extract``) and then streamed three ways: split once at every character
boundary, one character at a time (a split at every boundary at once), and in the deltas of the
incremental detokenizer over a byte-level BPE's tokens. The folded stream must equal the whole parse, every call must
start with its header before any argument fragment, and no markup may reach the content.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tokenmill.frontend.detokenizer import IncrementalDetokenizer
from tokenmill.frontend.tool_parsers import (
    ContentText,
    Event,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    NamedToolParser,
    RequiredToolParser,
    ToolCallArguments,
    ToolCallStart,
    ToolParser,
    detect_tool_parser,
    fold_events,
    get_tool_parser,
)

ParserFactory = Callable[[], ToolParser]
Expected = tuple[str, list[tuple[str, str]]]  # content, [(name, arguments)]

WEATHER = '{"city": "Paris", "unit": "celsius"}'
TRICKY = '{"cmd": "mkdir -p test/{a,b}", "q": "say \\"hi\\" }", "n": [1, {"x": null}], "u": "東京 👋"}'

CASES: list[tuple[str, ParserFactory, str, Expected]] = [
    # --- Hermes / Qwen
    ("hermes-content-only", HermesToolParser, "The weather is fine.  ", ("The weather is fine.  ", [])),
    (
        "hermes-one-call",
        HermesToolParser,
        f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
        ("", [("get_weather", WEATHER)]),
    ),
    (
        "hermes-content-then-two-calls",
        HermesToolParser,
        f'Let me check both.\n\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
        f'<tool_call>\n{{"name": "run", "arguments": {TRICKY}}}\n</tool_call>\n',
        ("Let me check both.", [("get_weather", WEATHER), ("run", TRICKY)]),
    ),
    (
        "hermes-arguments-before-name",
        HermesToolParser,
        '<tool_call>{"arguments": {"a": "}"}, "name": "f"}</tool_call>',
        ("", [("f", '{"a": "}"}')]),
    ),
    (
        "hermes-no-arguments",
        HermesToolParser,
        '<tool_call>{"name": "now"}</tool_call>',
        ("", [("now", "{}")]),
    ),
    (
        "hermes-string-arguments",
        HermesToolParser,
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
        ("", [("f", '{"a": 1}')]),
    ),
    (
        "hermes-not-a-call",
        HermesToolParser,
        "Use <tool_call>like this</tool_call> to call.",
        ("Use <tool_call>like this</tool_call> to call.", []),
    ),
    (
        "hermes-unclosed-after-name",  # max_tokens hit: the committed call keeps what was read
        HermesToolParser,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        ("", [("get_weather", '{"city": "Par')]),
    ),
    (
        "hermes-unclosed-before-name",  # never became a call: it is content
        HermesToolParser,
        'Checking <tool_call>\n{"na',
        ('Checking <tool_call>\n{"na', []),
    ),
    ("hermes-partial-tag-at-end", HermesToolParser, "Hi <tool_ca", ("Hi <tool_ca", [])),
    # --- Llama 3 JSON
    (
        "llama-python-tag",
        Llama3JsonToolParser,
        f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}',
        ("", [("get_weather", WEATHER)]),
    ),
    (
        "llama-two-calls",
        Llama3JsonToolParser,
        f' {{"name": "get_weather", "parameters": {WEATHER}}}; {{"name": "run", "parameters": {TRICKY}}}',
        ("", [("get_weather", WEATHER), ("run", TRICKY)]),
    ),
    ("llama-json-content", Llama3JsonToolParser, '{"answer": 42} is it', ('{"answer": 42} is it', [])),
    ("llama-plain", Llama3JsonToolParser, 'Say {"name": "x"}', ('Say {"name": "x"}', [])),
    # --- Mistral
    (
        "mistral-array",
        MistralToolParser,
        f'Sure. [TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, '
        f'{{"name": "run", "arguments": {TRICKY}}}]',
        ("Sure.", [("get_weather", WEATHER), ("run", TRICKY)]),
    ),
    (
        "mistral-args-format",
        MistralToolParser,
        f"[TOOL_CALLS]get_weather[ARGS]{WEATHER}[TOOL_CALLS]run[ARGS]{TRICKY}",
        ("", [("get_weather", WEATHER), ("run", TRICKY)]),
    ),
    (
        "mistral-spaced-markers",
        MistralToolParser,
        f"[TOOL_CALLS] get_weather [ARGS] {WEATHER} ",
        ("", [("get_weather", WEATHER)]),
    ),
    (
        "mistral-not-a-name",
        MistralToolParser,
        "[TOOL_CALLS]two words[ARGS]{}",
        ("[TOOL_CALLS]two words[ARGS]{}", []),
    ),
    # --- enforced choices (the grammar guarantees the JSON)
    ("named", lambda: NamedToolParser("get_weather"), "  " + WEATHER, ("", [("get_weather", WEATHER)])),
    (
        "required",
        RequiredToolParser,
        f'[{{"name": "get_weather", "parameters": {WEATHER}}}, {{"name": "run", "parameters": {TRICKY}}}]',
        ("", [("get_weather", WEATHER), ("run", TRICKY)]),
    ),
]

IDS = [case[0] for case in CASES]


def _summary(events: list[Event]) -> Expected:
    folded = fold_events(events)
    return folded.content, [(call.name, call.arguments) for call in folded.tool_calls]


def _stream(factory: ParserFactory, pieces: list[str]) -> list[Event]:
    parser = factory()
    events: list[Event] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def _check_stream_shape(events: list[Event], markup: list[str]) -> None:
    started: set[int] = set()
    ids: set[str] = set()
    for event in events:
        if isinstance(event, ToolCallStart):
            assert event.index == len(started)
            assert event.id.startswith("call_") and event.id not in ids
            started.add(event.index)
            ids.add(event.id)
        elif isinstance(event, ToolCallArguments):
            assert event.index in started, "arguments before the call's header"
            assert event.text
        else:
            assert event.text
            if started:  # once a call was made, markup in content would be a leak
                assert not any(marker in event.text for marker in markup), event.text


@pytest.mark.parametrize(("name", "factory", "text", "expected"), CASES, ids=IDS)
def test_extract(name: str, factory: ParserFactory, text: str, expected: Expected) -> None:
    result = factory().extract(text)
    assert (result.content, [(c.name, c.arguments) for c in result.tool_calls]) == expected
    if "unclosed" not in name:
        for _, arguments in expected[1]:
            assert isinstance(json.loads(arguments), dict)  # complete calls carry the model's JSON as is


@pytest.mark.parametrize(("name", "factory", "text", "expected"), CASES, ids=IDS)
def test_stream_any_split_equals_extract(
    name: str, factory: ParserFactory, text: str, expected: Expected
) -> None:
    markup = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>"]
    for cut in range(len(text) + 1):
        events = _stream(factory, [text[:cut], text[cut:]])
        assert _summary(events) == expected, f"split at {cut}: {text[:cut]!r} | {text[cut:]!r}"
        _check_stream_shape(events, markup)
    events = _stream(factory, list(text))
    assert _summary(events) == expected
    _check_stream_shape(events, markup)


@pytest.fixture(scope="module")
def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 / SmolLM2 style) trained here on the cases, so merges straddle markup.

    Loading SmolLM2's own tokenizer from its GGUF takes tens of seconds; this one builds in
    milliseconds and splits multi-byte characters across tokens just the same.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator([case[2] for case in CASES] * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


@pytest.mark.parametrize(("name", "factory", "text", "expected"), CASES, ids=IDS)
def test_stream_real_token_boundaries(
    bpe_tokenizer: PreTrainedTokenizerFast, name: str, factory: ParserFactory, text: str, expected: Expected
) -> None:
    token_ids = bpe_tokenizer.encode(text, add_special_tokens=False)
    assert len(token_ids) < len(text.encode())  # merges happened: tokens span several characters
    detokenizer = IncrementalDetokenizer(
        bpe_tokenizer, [], skip_special_tokens=False, spaces_between_special_tokens=False
    )
    pieces = [detokenizer.push([token]) for token in token_ids] + [detokenizer.finish()]
    assert "".join(pieces) == text
    assert _summary(_stream(factory, pieces)) == expected


def test_stream_sends_header_before_arguments_and_fragments_as_they_come() -> None:
    parser = HermesToolParser()
    assert parser.feed("<tool_") == []
    assert parser.feed('call>\n{"name": "get_w') == []
    [start] = parser.feed('eather", "argu')
    assert isinstance(start, ToolCallStart) and start.name == "get_weather" and start.index == 0
    assert parser.feed('ments": {"ci') == [ToolCallArguments(0, '{"ci')]
    assert parser.feed('ty": "Pa}ris"}}\n</tool') == [ToolCallArguments(0, 'ty": "Pa}ris"}')]
    assert parser.feed("_call>\nDone") == [ContentText("Done")]
    assert parser.finish() == []


def test_whitespace_rule_keeps_plain_content_exact() -> None:
    text = "  spaced\n\n out  \n"
    assert HermesToolParser().extract(text).content == text
    assert _summary(_stream(HermesToolParser, list(text)))[0] == text


def test_registry_and_detection() -> None:
    assert get_tool_parser("hermes") is HermesToolParser
    assert get_tool_parser("qwen") is HermesToolParser
    with pytest.raises(
        ValueError, match="unknown tool-call parser 'nope'; known parsers: gpt_oss, hermes, llama3_json"
    ):
        get_tool_parser("nope")
    assert detect_tool_parser("... <tool_call>\n{{ tool | tojson }} ...") == "hermes"
    assert detect_tool_parser("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect_tool_parser("{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect_tool_parser('<|start_header_id|> ... {"name": fn, "parameters": args}') == "llama3_json"
    assert detect_tool_parser("{{ m.content }}", ["Qwen2ForCausalLM"]) == "hermes"
    assert detect_tool_parser("{{ m.content }}", ["LlamaForCausalLM"]) is None
    assert detect_tool_parser(None) is None
