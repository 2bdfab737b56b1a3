"""gpt-oss's harmony format through a real server: reasoning and tool calls, streamed and not.

A scripted model (``scripted_model.py``) writes harmony on cue. Its channel markup tokens are special
tokens of its tokenizer, as in gpt-oss's, so the server must keep special tokens in the text for the
parsers (``--reasoning-parser openai_gptoss --tool-call-parser openai``) to see them. A first-order
script cannot repeat a token, so each token carries a whole run of markup (``<|end|><|start|>
assistant<|channel|>final<|message|>``). A second server runs the tiny random gpt-oss natively.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from scripted_model import build_scripted_model
from server_process import TINY_ARGS, ServerProcess
from test_tool_calls import TOOLS, _collect
from transformers import AutoTokenizer

MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
SCRIPTS = {
    "sum?": [
        "<|channel|>analysis<|message|>",
        "User",
        "wants",
        "2+2.",
        "<|end|><|start|>assistant<|channel|>final<|message|>",
        "It",
        "is",
        "4.",
        "<|return|>",
    ],
    "weather?": [
        "<|channel|>analysis <|message|>",
        "Need",
        "the",
        "weather.",
        "<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
        '{"city":',
        '"Paris"}',
        "<|call|>",
        "Hallucinated",  # what a model goes on with if <|call|> does not end the turn
        "result.",
    ],
}
SPECIAL = [piece for pieces in SCRIPTS.values() for piece in pieces if "<|" in piece]


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = str(tmp_path_factory.mktemp("harmony-scripted"))
    build_scripted_model(path, SCRIPTS)
    tokenizer = AutoTokenizer.from_pretrained(path)
    # The script's markup tokens (same ids) and the bare markers become special tokens.
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL + MARKERS})
    assert tokenizer.convert_tokens_to_ids(SPECIAL[0]) < 64  # kept its id: the model's vocabulary
    tokenizer.save_pretrained(path)
    args = [
        *TINY_ARGS,
        "--served-model-name",
        "scripted",  # the name test_tool_calls._collect asks for
        "--reasoning-parser",
        "openai_gptoss",
        "--tool-call-parser",
        "openai",
    ]
    server = ServerProcess(path, args)
    yield server
    server.stop()


def _ask(cue: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"please answer {cue}"}]


def test_reasoning_and_final_channels_separate(harmony_server: ServerProcess) -> None:
    response = harmony_server.client().chat.completions.create(
        model="scripted", messages=_ask("sum?"), max_tokens=30
    )  # type: ignore[arg-type]
    [choice] = response.choices
    assert choice.message.model_extra["reasoning_content"] == "User wants 2+2."
    assert choice.message.content == "It is 4."
    assert choice.finish_reason == "stop"
    # Streamed: the same split, reasoning deltas before any content.
    with harmony_server.client().chat.completions.create(
        model="scripted", messages=_ask("sum?"), max_tokens=30, stream=True
    ) as stream:  # type: ignore[arg-type]
        reasoning, content, kinds = "", "", []
        for chunk in stream:
            for streamed in chunk.choices:
                delta = streamed.delta
                if (delta.model_extra or {}).get("reasoning_content"):
                    reasoning += delta.model_extra["reasoning_content"]
                    kinds.append("reasoning")
                if delta.content:
                    content += delta.content
                    kinds.append("content")
    assert (reasoning, content) == ("User wants 2+2.", "It is 4.")
    assert kinds.index("content") > max(i for i, k in enumerate(kinds) if k == "reasoning")
    assert not any("<|" in text for text in (reasoning, content))


def test_harmony_tool_call(harmony_server: ServerProcess) -> None:
    response = harmony_server.client().chat.completions.create(
        model="scripted", messages=_ask("weather?"), tools=TOOLS, max_tokens=30
    )  # type: ignore[arg-type]
    [choice] = response.choices
    assert choice.finish_reason == "tool_calls"
    # <|call|> (not an EOS in gpt-oss's config) stopped the turn: the script up to it, nothing after.
    assert response.usage.completion_tokens == SCRIPTS["weather?"].index("<|call|>") + 1
    assert choice.message.model_extra["reasoning_content"] == "Need the weather."
    assert choice.message.content is None
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    state = _collect(harmony_server, "weather?")["choices"][0]
    assert state["reasoning"] == "Need the weather." and state["content"] == ""
    assert [(c["name"], c["arguments"]) for c in state["calls"]] == [("get_weather", '{"city": "Paris"}')]
    assert state["finish"] == "tool_calls"


def test_tiny_gpt_oss_serves_natively(tmp_path_factory: pytest.TempPathFactory) -> None:
    from tests.conftest import save_tiny_model
    from tests.models.test_gpt_oss import GPT_OSS

    path = str(tmp_path_factory.mktemp("tiny-gpt-oss-server"))
    save_tiny_model(GPT_OSS, seed=5, folder=path)
    server = ServerProcess(
        path, [*TINY_ARGS, "--served-model-name", "gpt-oss", "--reasoning-parser", "gpt_oss"]
    )
    try:
        response = server.client().chat.completions.create(
            model="gpt-oss", messages=_ask("hello"), max_tokens=12, temperature=0
        )  # type: ignore[arg-type]
        [choice] = response.choices
        # Random weights write no harmony markup: all of it is content.
        assert choice.finish_reason == "length" and response.usage.completion_tokens == 12
        assert choice.message.content and choice.message.model_extra.get("reasoning_content") is None
    finally:
        server.stop()
