"""Tool-call parsers: one module per output format, and the registry that picks one for a model.

``get_tool_parser(name)`` returns the parser class for ``--tool-call-parser NAME``;
``detect_tool_parser(chat_template, architectures)`` guesses the format from the model's chat
template (the markup it teaches the model) and, failing that, from its architecture. See
``base.py`` for the contract every parser keeps.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.frontend.tool_parsers.base import (
    ContentText,
    Event,
    ExtractedToolCalls,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
    ToolParser,
    fold_events,
    new_call_id,
)
from tokenmill.frontend.tool_parsers.enforced import NamedToolParser, RequiredToolParser
from tokenmill.frontend.tool_parsers.harmony import HarmonyToolParser
from tokenmill.frontend.tool_parsers.hermes import HermesToolParser
from tokenmill.frontend.tool_parsers.llama3_json import Llama3JsonToolParser
from tokenmill.frontend.tool_parsers.mistral import MistralToolParser

__all__ = [
    "TOOL_PARSERS",
    "ContentText",
    "Event",
    "ExtractedToolCalls",
    "HarmonyToolParser",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "NamedToolParser",
    "RequiredToolParser",
    "ToolCall",
    "ToolCallArguments",
    "ToolCallStart",
    "ToolParser",
    "detect_tool_parser",
    "fold_events",
    "get_tool_parser",
    "new_call_id",
]

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "openai": HarmonyToolParser,  # vLLM's name for gpt-oss's harmony calls
    "gpt_oss": HarmonyToolParser,
}

# Markup a chat template writes when it teaches the model a format, checked in this order.
_TEMPLATE_MARKERS = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
    ("<|channel|>", "openai"),  # harmony (gpt-oss)
)
_ARCHITECTURES = {
    "Qwen2ForCausalLM": "hermes",
    "Qwen3ForCausalLM": "hermes",
    "MistralForCausalLM": "mistral",
    "GptOssForCausalLM": "openai",
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name``; ValueError listing the known names otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool-call parser {name!r}; known parsers: {known}") from None


def detect_tool_parser(chat_template: str | None, architectures: Sequence[str] = ()) -> str | None:
    """The parser name for a model, from its chat template's markup, else its architecture, else None."""
    if chat_template:
        for marker, name in _TEMPLATE_MARKERS:
            if marker in chat_template:
                return name
        # Llama 3.1's template asks for {"name": ..., "parameters": ...} without a python tag.
        if "<|start_header_id|>" in chat_template and '"parameters"' in chat_template:
            return "llama3_json"
    for architecture in architectures:
        if architecture in _ARCHITECTURES:
            return _ARCHITECTURES[architecture]
    return None
