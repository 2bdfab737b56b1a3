"""The harmony response format (gpt-oss): a completion is a run of messages, each on a channel.

A message is a header, ``<|message|>``, a body and a terminator::

    <|channel|>analysis<|message|>The user wants ...<|end|>
    <|start|>assistant<|channel|>final<|message|>It is 4.<|return|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The first message's ``<|start|>assistant`` is in the prompt. ``analysis`` is the reasoning, ``final``
the answer, ``commentary`` either a preamble to the user or, with a recipient (``to=functions.NAME``,
which may also stand before ``<|channel|>``), a tool call whose body is the arguments. Terminators are
``<|end|>``, ``<|return|>`` (the last message) and ``<|call|>`` (a tool call).

``HarmonyStream`` splits streamed text into ``HarmonyEvent``s: a ``header`` once a message's
``<|message|>`` arrives (with its channel, recipient and raw header text), ``body`` fragments, and
``end`` with the terminator. Whitespace at either edge of a body is dropped (whitespace touching
markup, as the other parsers drop it). It holds back only text that may be the start of a marker or
trailing whitespace, so any split of the text gives the same events once adjacent body fragments are
joined. Text before any header is
the body of a message with no channel; a new ``<|start|>`` or ``<|channel|>`` inside a body ends that
message (a model that skipped a terminator). The markers are special tokens of gpt-oss's tokenizer:
the serving layer keeps special tokens in the text for a harmony parser.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CALL = "<|call|>"
TERMINATORS = ("<|end|>", "<|return|>", CALL)
_HEADER_STARTS = (START, CHANNEL)
_BODY_MARKERS = TERMINATORS + _HEADER_STARTS
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass
class HarmonyEvent:
    """``kind`` is ``header`` (``channel``, ``recipient``, ``text`` = the raw header before
    ``<|message|>``), ``body`` (``text`` = a fragment of the body) or ``end`` (``text`` = the
    terminator, empty when the text ended or a new header cut the message)."""

    kind: str
    text: str = ""
    channel: str | None = None
    recipient: str | None = None


class HarmonyStream:
    """Incremental splitter of one completion's harmony text (module docstring)."""

    def __init__(self) -> None:
        self._state = "between"  # between messages | header | body
        self._buffer = ""
        self._body_started = False  # the open body has non-whitespace text
        self._body_ws = ""  # whitespace after the body's last text, dropped if the body ends

    def _body(self, events: list[HarmonyEvent], text: str) -> None:
        if not self._body_started:
            text = text.lstrip()
        kept = text.rstrip()
        if kept:
            events.append(HarmonyEvent("body", self._body_ws + kept))
            self._body_started, self._body_ws = True, ""
        if self._body_started:
            self._body_ws += text[len(kept) :]

    def _end(self, events: list[HarmonyEvent], terminator: str = "") -> None:
        events.append(HarmonyEvent("end", terminator))
        self._body_started, self._body_ws = False, ""

    def feed(self, text: str) -> list[HarmonyEvent]:
        self._buffer += text
        events: list[HarmonyEvent] = []
        while self._buffer:
            if self._state == "between":
                stripped = self._buffer.lstrip()
                if not stripped:
                    self._buffer = ""  # whitespace between messages is dropped
                    break
                if stripped.startswith(_HEADER_STARTS):
                    self._buffer, self._state = stripped, "header"
                elif any(marker.startswith(stripped) for marker in _HEADER_STARTS):
                    self._buffer = stripped  # maybe a header, not complete yet
                    break
                else:  # text without a header: a message on no channel
                    self._buffer, self._state = stripped, "body"
                    events.append(HarmonyEvent("header"))
            elif self._state == "header":
                at = self._buffer.find(MESSAGE)
                if at < 0:
                    break
                header, self._buffer = self._buffer[:at], self._buffer[at + len(MESSAGE) :]
                events.append(_header_event(header))
                self._state = "body"
            else:
                if not self._read_body(events):
                    break
        return events

    def finish(self) -> list[HarmonyEvent]:
        """Events of the text's end: the rest of an open body, then its ``end`` (a header never closed
        by ``<|message|>`` is dropped: it has no body)."""
        events: list[HarmonyEvent] = []
        if self._state == "body":
            self._body(events, self._buffer)
            self._end(events)
        self._buffer, self._state = "", "between"
        return events

    def _read_body(self, events: list[HarmonyEvent]) -> bool:
        """Consume body text up to the next marker; False when more text is needed."""
        buffer = self._buffer
        found = [(buffer.find(m), m) for m in _BODY_MARKERS if m in buffer]
        if not found:
            keep = max(_marker_prefix_len(buffer, m) for m in _BODY_MARKERS)
            self._body(events, buffer[: len(buffer) - keep])
            self._buffer = buffer[len(buffer) - keep :]
            return False
        at, marker = min(found)
        self._body(events, buffer[:at])
        if marker in TERMINATORS:
            self._end(events, marker)
            self._buffer = buffer[at + len(marker) :]
        else:  # a new header without a terminator: the message ends here
            self._end(events)
            self._buffer = buffer[at:]
        self._state = "between"
        return True


def _header_event(header: str) -> HarmonyEvent:
    channel = _CHANNEL_NAME.search(header)
    recipient = _RECIPIENT.search(header)
    return HarmonyEvent(
        "header",
        header,
        channel=channel.group(1) if channel else None,
        recipient=recipient.group(1) if recipient else None,
    )


def _marker_prefix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker`` (held back).
    (The tool parsers' helper of the same name; not imported, since they import this module.)"""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
