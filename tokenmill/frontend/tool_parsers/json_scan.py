"""Incremental reading of the JSON a model writes for a tool call, one character at a time.

Streaming tool calls go wrong when a parser re-serializes partially parsed JSON and diffs it against
what it sent before (arguments duplicated, dropped or turned into invalid JSON on escapes, braces
inside strings or multi-byte text). Here nothing is re-serialized: the arguments value is passed on
as the exact characters the model wrote, and the only thing tracked is the structure needed to know
where each value ends (strings, escapes, nesting depth). Feeding text in any split therefore yields
the same events in the same order, with fragments whose concatenation is the same string.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ARGUMENT_KEYS = ("arguments", "parameters")
_WHITESPACE = " \t\r\n"


class JsonValueScanner:
    """Finds where one JSON value ends. ``push(ch)`` says whether ``ch`` belongs to the value.

    Containers and strings end on their closing character (which belongs to the value); numbers and
    literals end on the first character that cannot continue them (which does not). Only structure is
    checked: ``{"a" 1}`` passes, since judging the model's JSON is the client's business.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.first: str | None = None
        self.done = False

    def push(self, ch: str) -> bool:
        if self.first is None:
            self.first = ch
            if ch in "{[":
                self.depth = 1
            elif ch == '"':
                self.in_string = True
            return True
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                if self.depth == 0:
                    self.done = True
            return True
        if self.depth == 0:  # a number or literal: ends at the first delimiter
            if ch in _WHITESPACE or ch in ",}]":
                self.done = True
                return False
            return True
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                self.done = True
        return True

    def finish_scalar(self) -> bool:
        """At the end of the text: a number or literal is complete there; a container or string is not."""
        if self.first is not None and self.first not in '{["' and not self.done:
            self.done = True
        return self.done


@dataclass
class CallEvent:
    """What reading a tool-call object produced: its ``name``, an ``arguments`` fragment, or its ``end``."""

    kind: str  # "name" | "arguments" | "end" | "error"
    text: str = ""


class ToolCallObjectReader:
    """Reads one ``{"name": ..., "arguments": ...}`` object (``parameters`` is accepted for arguments).

    ``feed(text)`` consumes characters until the object ends or turns out malformed and returns the
    events plus how many characters it consumed (the rest belongs to whatever follows the object).
    An arguments value that is an object or array is passed on raw, fragment by fragment; one that is
    a JSON string (some models encode the arguments as a string) is decoded once complete.
    """

    def __init__(self) -> None:
        self.state = "open"
        self.key_raw = ""
        self.key = ""
        self.value: JsonValueScanner | None = None
        self.value_raw = ""
        self.name: str | None = None
        self.saw_arguments = False
        self.value_is_arguments = False  # the value being read is the (first) arguments value
        self.closed = False  # ended, well formed or not

    def feed(self, text: str) -> tuple[list[CallEvent], int]:
        events: list[CallEvent] = []
        streamed = ""  # raw argument characters of this feed, sent as one fragment
        i = 0
        while i < len(text) and not self.closed:
            ch = text[i]
            state = self.state
            if state == "value":
                assert self.value is not None
                if self.value.push(ch):
                    if self._streams_arguments():
                        streamed += ch
                    else:
                        self.value_raw += ch
                    i += 1
                if self.value.done:
                    if streamed:
                        events.append(CallEvent("arguments", streamed))
                        streamed = ""
                    self._end_value(events)
                continue
            i += 1
            if ch in _WHITESPACE and state != "key":
                continue
            if state == "open":
                self._expect(ch == "{", "key_or_end", events)
            elif state in ("key_or_end", "key_start"):
                if ch == '"':
                    self.state, self.key_raw = "key", '"'
                elif ch == "}" and state == "key_or_end":
                    self._close(events)
                else:
                    self._fail(events)
            elif state == "key":
                self.key_raw += ch
                if ch == '"' and not _escaped(self.key_raw):
                    self.key = json.loads(self.key_raw)
                    self.state = "colon"
            elif state == "colon":
                self._expect(ch == ":", "value_start", events)
            elif state == "value_start":
                self.value, self.value_raw, self.state = JsonValueScanner(), "", "value"
                self.value_is_arguments = self.key in ARGUMENT_KEYS and not self.saw_arguments
                self.saw_arguments = self.saw_arguments or self.value_is_arguments
                i -= 1  # the scanner takes this character
            elif state == "comma_or_end":
                if ch == ",":
                    self.state = "key_start"
                elif ch == "}":
                    self._close(events)
                else:
                    self._fail(events)
        if streamed:
            events.append(CallEvent("arguments", streamed))
        return events, i

    def finish(self) -> list[CallEvent]:
        """The text ended: a pending number or literal value completes; anything else stays unclosed."""
        events: list[CallEvent] = []
        if self.state == "value" and self.value is not None and self.value.finish_scalar():
            self._end_value(events)
        return events

    def _streams_arguments(self) -> bool:
        assert self.value is not None
        return self.value_is_arguments and self.value.first in ("{", "[")

    def _end_value(self, events: list[CallEvent]) -> None:
        assert self.value is not None
        first = self.value.first
        self.state = "comma_or_end"
        if self.key == "name":
            try:
                name = json.loads(self.value_raw)
            except ValueError:
                name = None
            if not isinstance(name, str) or not name:
                self._fail(events)
                return
            if self.name is None:
                self.name = name
                events.append(CallEvent("name", name))
        elif self.value_is_arguments:
            if first == '"':
                try:
                    decoded = json.loads(self.value_raw)
                except ValueError:
                    decoded = self.value_raw
                events.append(CallEvent("arguments", decoded))
            elif first not in ("{", "["):
                events.append(CallEvent("arguments", self.value_raw))
        self.value = None

    def _expect(self, ok: bool, next_state: str, events: list[CallEvent]) -> None:
        if ok:
            self.state = next_state
        else:
            self._fail(events)

    def _close(self, events: list[CallEvent]) -> None:
        self.closed = True
        events.append(CallEvent("end") if self.name is not None else CallEvent("error"))

    def _fail(self, events: list[CallEvent]) -> None:
        self.closed = True
        events.append(CallEvent("error"))


def _escaped(raw: str) -> bool:
    """Whether the final quote of ``raw`` is escaped (an odd run of backslashes before it)."""
    count = 0
    for ch in reversed(raw[:-1]):
        if ch != "\\":
            break
        count += 1
    return count % 2 == 1
