"""One chat choice's output text → OpenAI message parts: reasoning, content and tool calls.

The reasoning parser (if any) splits the text first; the tool parser (if any) reads only the
content part, so a ``<tool_call>`` written while thinking is reasoning, not a call. ``feed``/
``finish`` give OpenAI stream deltas; ``parse`` gives the non-streamed message. Both run the same
parsers, so the concatenated deltas always equal the whole message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.frontend.reasoning_parsers import ThinkReasoningParser
from tokenmill.frontend.tool_parsers import (
    ContentText,
    Event,
    ToolCall,
    ToolCallStart,
    ToolParser,
    fold_events,
)


@dataclass
class ChatMessageParts:
    """A finished message: ``content`` is None when empty and the message has calls or reasoning."""

    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ChatOutputParser:
    """Parses one choice. ``max_tool_calls`` (1 when ``parallel_tool_calls`` is false) drops later calls."""

    def __init__(
        self,
        tool_parser: ToolParser | None = None,
        reasoning_parser: ThinkReasoningParser | None = None,
        max_tool_calls: int | None = None,
    ) -> None:
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.max_tool_calls = max_tool_calls
        self.num_tool_calls = 0

    @property
    def made_tool_calls(self) -> bool:
        return self.num_tool_calls > 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        """OpenAI ``delta`` objects for the next piece of text (possibly none while markup is pending)."""
        if self.reasoning_parser is None:
            return self._deltas("", self._tool_events(text, final=False))
        reasoning, content = self.reasoning_parser.feed(text)
        return self._deltas(reasoning, self._tool_events(content, final=False))

    def finish(self) -> list[dict[str, Any]]:
        """The deltas the end of the text releases."""
        reasoning, content = self.reasoning_parser.finish() if self.reasoning_parser is not None else ("", "")
        return self._deltas(reasoning, self._tool_events(content, final=True))

    def parse(self, text: str) -> ChatMessageParts:
        """The whole message (call on a fresh parser)."""
        reasoning: list[str] = []
        events: list[Event] = []
        for delta_text, final in ((text, False), ("", True)):
            if self.reasoning_parser is not None:
                r, c = self.reasoning_parser.feed(delta_text) if not final else self.reasoning_parser.finish()
                reasoning.append(r)
            else:
                c = delta_text
            events += self._tool_events(c, final)
        folded = fold_events(events)
        reasoning_text = "".join(reasoning) or None
        content: str | None = folded.content
        if not content and (folded.tool_calls or reasoning_text is not None):
            content = None
        return ChatMessageParts(content, reasoning_text, folded.tool_calls)

    def _tool_events(self, text: str, final: bool) -> list[Event]:
        if self.tool_parser is None:
            return [ContentText(text)] if text else []
        events = self.tool_parser.feed(text) if text else []
        if final:
            events += self.tool_parser.finish()
        kept: list[Event] = []
        for event in events:
            if not isinstance(event, ContentText):
                if self.max_tool_calls is not None and event.index >= self.max_tool_calls:
                    continue
                if isinstance(event, ToolCallStart):
                    self.num_tool_calls += 1
            kept.append(event)
        return kept

    @staticmethod
    def _deltas(reasoning: str, events: list[Event]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        if reasoning:
            deltas.append({"reasoning_content": reasoning})
        for event in events:
            last = deltas[-1] if deltas else None
            if isinstance(event, ContentText):
                if last is not None and "content" in last:
                    last["content"] += event.text
                else:
                    deltas.append({"content": event.text})
            elif isinstance(event, ToolCallStart):
                function = {"name": event.name, "arguments": ""}
                call = {"index": event.index, "id": event.id, "type": "function", "function": function}
                deltas.append({"tool_calls": [call]})
            else:
                # Fragments of one call merge, but never into its header (which keeps arguments "").
                previous = last["tool_calls"][0] if last is not None and "tool_calls" in last else None
                if previous is not None and previous["index"] == event.index and "id" not in previous:
                    previous["function"]["arguments"] += event.text
                else:
                    function = {"arguments": event.text}
                    deltas.append({"tool_calls": [{"index": event.index, "function": function}]})
        return deltas
