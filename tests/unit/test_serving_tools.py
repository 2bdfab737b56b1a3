"""The serving layer's tool plan, without a server: parser choice, grammars, special-token formats.

A Mistral-style tokenizer marks ``[TOOL_CALLS]`` and ``[ARGS]`` special, so ``auto`` must keep
special tokens in the text (or the parser would never see the markers) and must not let the EOS
text that then appears reach the content.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tokenmill.frontend.detokenizer import IncrementalDetokenizer
from tokenmill.frontend.output_processor import SampleState
from tokenmill.frontend.stop_checker import StopStringChecker
from tokenmill.frontend.tool_parsers import (
    HermesToolParser,
    MistralToolParser,
    NamedToolParser,
    RequiredToolParser,
)
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.errors import APIError
from tokenmill.server.openai_protocol import ChatCompletionRequest
from tokenmill.server.serving_tools import plan_chat_tools

WORDS = ["<unk>", "</s>", "[TOOL_CALLS]", "[ARGS]", "get_weather", '{"city":', '"Paris"}', "Sure"]
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {}}}},
    }
]


@pytest.fixture(scope="module")
def mistral_like() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    fast.chat_template = "{{ '[TOOL_CALLS]' if tools }}{% for m in messages %}{{ m.content }}{% endfor %}"
    return fast


def _ctx(
    tokenizer: PreTrainedTokenizerFast, tool_call_parser: str | None = None, reasoning: str | None = None
) -> Any:
    engine = SimpleNamespace(
        tokenizer=tokenizer,
        input_processor=SimpleNamespace(eos_token_ids=[1]),
        source=SimpleNamespace(hf_config=SimpleNamespace(architectures=["MistralForCausalLM"])),
    )
    return SimpleNamespace(
        engine=engine, settings=SimpleNamespace(tool_call_parser=tool_call_parser, reasoning_parser=reasoning)
    )


def _body(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_auto_detects_the_format_and_keeps_its_special_markers(mistral_like: PreTrainedTokenizerFast) -> None:
    plan = plan_chat_tools(_body(tools=TOOLS), _ctx(mistral_like))
    assert plan.template_tools == TOOLS and plan.structured_outputs is None
    assert plan.make_tool_parser is MistralToolParser and plan.keep_special_tokens
    params = plan.apply(SamplingParams())
    assert not params.skip_special_tokens and not params.spaces_between_special_tokens

    # The engine's tokens, detokenized as the output processor does with those settings.
    ids = [7, 2, 4, 3, 5, 6, 1]  # Sure [TOOL_CALLS] get_weather [ARGS] {"city": "Paris"} </s>
    [output] = plan.choice_outputs(_ctx(mistral_like), "hi", n=1) or []
    # This tokenizer has no decoder, so its decode joins every token with a space, markers included.
    detokenizer = IncrementalDetokenizer(
        mistral_like, [], skip_special_tokens=False, spaces_between_special_tokens=False
    )
    sample = SampleState(0, "r", detokenizer, StopStringChecker([], False))
    deltas: list[dict[str, Any]] = []
    for position, token in enumerate(ids):
        sample.token_ids.append(token)
        text = detokenizer.push([token])
        if position == len(ids) - 1:
            text += detokenizer.finish()
            sample.finish_reason = "stop"
        sample.text += text
        deltas += output.deltas(sample, text, finishing=sample.finish_reason is not None)
    assert sample.text.endswith("</s>")
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert content == "Sure"  # neither the markers nor the EOS text
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    assert output.finish_reason(sample) == "tool_calls"

    [fresh] = plan.choice_outputs(_ctx(mistral_like), "hi", n=1) or []
    message = fresh.message(sample)
    assert message.content == "Sure"
    assert [(c.name, c.arguments) for c in message.tool_calls] == [("get_weather", '{"city": "Paris"}')]


def test_server_flag_wins_over_detection(mistral_like: PreTrainedTokenizerFast) -> None:
    plan = plan_chat_tools(_body(tools=TOOLS), _ctx(mistral_like, tool_call_parser="hermes"))
    assert plan.make_tool_parser is HermesToolParser and not plan.keep_special_tokens


def test_enforced_choices_set_a_json_schema(mistral_like: PreTrainedTokenizerFast) -> None:
    ctx = _ctx(mistral_like, reasoning="qwen3")
    named = plan_chat_tools(
        _body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}), ctx
    )
    assert named.structured_outputs is not None and named.structured_outputs.json is not None
    assert json.loads(named.structured_outputs.json) == TOOLS[0]["function"]["parameters"]
    assert named.make_tool_parser is not None and isinstance(named.make_tool_parser(), NamedToolParser)
    [output] = named.choice_outputs(ctx, "prompt <think>\n", n=1) or []
    assert output.parser.reasoning_parser is None
    required = plan_chat_tools(_body(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), ctx)
    assert required.make_tool_parser is RequiredToolParser and required.max_tool_calls == 1
    assert required.structured_outputs is not None and required.structured_outputs.json is not None
    assert json.loads(required.structured_outputs.json)["maxItems"] == 1
    assert required.apply(SamplingParams()).structured_outputs == required.structured_outputs
    with pytest.raises(APIError, match="cannot be combined with another output constraint"):
        required.apply(SamplingParams(structured_outputs={"regex": "a+"}))  # type: ignore[arg-type]


def test_none_and_no_tools(mistral_like: PreTrainedTokenizerFast) -> None:
    ctx = _ctx(mistral_like, reasoning="qwen3")
    hidden = plan_chat_tools(_body(tools=TOOLS, tool_choice="none"), ctx)
    assert hidden.template_tools is None and hidden.make_tool_parser is None
    [output] = hidden.choice_outputs(ctx, "prompt <think>\n", n=1) or []  # reasoning still splits
    assert output.parser.reasoning_parser is not None
    plain = plan_chat_tools(_body(), _ctx(mistral_like))
    assert plain.choice_outputs(_ctx(mistral_like), "p", n=2) is None  # text passes through untouched
