"""Llama 3.1+ JSON tool calls: ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``.

The model answers either with content or, from its first character, with one call object; further
calls follow after ``;`` (or a newline). An opening object that turns out not to be a call (no
``name``) is content, as is anything after the calls that is not another call.
"""

from __future__ import annotations

from tokenmill.frontend.tool_parsers.base import ToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    special_markers = (PYTHON_TAG,)

    def __init__(self) -> None:
        super().__init__()
        self._state = "start"  # start | object | between | next | content
        self._buffer = ""
        self._prefix = ""  # leading whitespace and tag before the first object

    def _parse(self, text: str) -> None:
        self._buffer += text
        while self._buffer:
            buffer = self._buffer
            if self._state == "start":
                stripped = buffer.lstrip()
                if not stripped:
                    return
                if stripped.startswith(PYTHON_TAG):
                    cut = len(buffer) - len(stripped) + len(PYTHON_TAG)
                    self._prefix += buffer[:cut]
                    self._buffer = buffer[cut:]
                    continue
                if PYTHON_TAG.startswith(stripped):
                    return  # maybe the tag, not complete yet
                lead = buffer[: len(buffer) - len(stripped)]
                if stripped[0] == "{":
                    self._start_object(self._prefix + lead)
                    self._buffer = stripped
                    self._state = "object"
                else:
                    self._buffer = ""
                    self._state = "content"
                    self._emit_content(self._prefix + buffer)
                self._prefix = ""
            elif self._state == "object":
                consumed, status = self._feed_object(buffer)
                self._buffer = buffer[consumed:]
                if status == "open":
                    return
                self._state = "between" if status == "ended" else "content"
            elif self._state in ("between", "next"):
                stripped = buffer.lstrip()
                if not stripped:
                    self._buffer = ""
                    return
                if stripped[0] == ";" and self._state == "between":
                    self._buffer, self._state = stripped[1:], "next"
                elif stripped[0] == "{":
                    self._start_object("")
                    self._buffer, self._state = stripped, "object"
                else:
                    self._buffer, self._state = "", "content"
                    self._emit_content(stripped)
            else:
                self._buffer = ""
                self._emit_content(buffer)

    def _parse_end(self) -> None:
        if self._state == "start":
            self._emit_content(self._prefix + self._buffer)
        elif self._state == "object":
            self._finish_object()
        self._buffer = self._prefix = ""
