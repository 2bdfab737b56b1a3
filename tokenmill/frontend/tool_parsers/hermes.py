"""Hermes / Qwen tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number.

Qwen2.5, Qwen3 and Hermes models write each call as a JSON object between the tags, usually on
lines of their own, and may write content before the first call.
"""

from __future__ import annotations

from tokenmill.frontend.tool_parsers.base import ToolParser, marker_prefix_len

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self) -> None:
        super().__init__()
        self._state = "content"  # content | object | close_tag
        self._buffer = ""

    def _parse(self, text: str) -> None:
        self._buffer += text
        while self._buffer:
            buffer = self._buffer
            if self._state == "content":
                at = buffer.find(START)
                if at < 0:
                    keep = marker_prefix_len(buffer, START)
                    self._emit_content(buffer[: len(buffer) - keep])
                    self._buffer = buffer[len(buffer) - keep :]
                    return
                self._emit_content(buffer[:at])
                self._buffer = buffer[at + len(START) :]
                self._start_object(START)
                self._state = "object"
            elif self._state == "object":
                consumed, status = self._feed_object(buffer)
                self._buffer = buffer[consumed:]
                if status == "open":
                    return
                self._state = "close_tag" if status == "ended" else "content"
            else:  # close_tag: whatever sits between the object and </tool_call> is dropped
                at = buffer.find(END)
                if at < 0:
                    self._buffer = buffer[len(buffer) - marker_prefix_len(buffer, END) :]
                    return
                self._buffer = buffer[at + len(END) :]
                self._state = "content"

    def _parse_end(self) -> None:
        if self._state == "content":
            self._emit_content(self._buffer)
        elif self._state == "object":
            self._finish_object()
        self._buffer = ""
