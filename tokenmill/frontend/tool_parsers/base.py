"""The tool-call parser contract and the machinery every format shares.

A parser reads a completion's text as it streams and turns it into events: ``ContentText`` (text
outside tool calls), ``ToolCallStart`` (index, id, function name) and ``ToolCallArguments``
(a fragment of the arguments JSON string). The same state machine serves both APIs: ``extract(text)``
is ``feed(text)`` then ``finish()`` with the events folded together, so a streamed answer equals the
non-streamed one by construction, whatever the split of the text into deltas.

Guarantees, for every format:

- A call's ``ToolCallStart`` comes before its arguments; the concatenated ``ToolCallArguments`` of a
  call are exactly its final arguments string (raw model text, never re-serialized). A call whose
  arguments never appear gets ``"{}"``.
- Markup (tags, markers, the JSON wrapper around the name) never reaches ``ContentText``, unless the
  markup turns out not to be a tool call: text held back while undecided is then released as content.
- A call is committed once its name is known. A committed call is never taken back: if the text
  ends before the call closes (e.g. ``max_tokens``), it is returned with the arguments read so far,
  as OpenAI does with ``finish_reason: "length"``. Text ending before the name is known is content.
- Whitespace between content and tool-call markup is dropped; a response without tool calls keeps
  its content exactly.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tokenmill.frontend.tool_parsers.json_scan import ToolCallObjectReader


def new_call_id() -> str:
    """A fresh OpenAI-style tool-call id, ``call_`` and 24 random hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ContentText:
    text: str


@dataclass
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass
class ToolCallArguments:
    index: int
    text: str


Event = ContentText | ToolCallStart | ToolCallArguments


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ExtractedToolCalls:
    """A whole completion split into content (text outside calls) and tool calls."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


def fold_events(events: list[Event]) -> ExtractedToolCalls:
    """Fold a stream of events into the content and calls they describe."""
    content: list[str] = []
    calls: list[ToolCall] = []
    for event in events:
        if isinstance(event, ContentText):
            content.append(event.text)
        elif isinstance(event, ToolCallStart):
            assert event.index == len(calls), "tool calls start in index order"
            calls.append(ToolCall(event.id, event.name, ""))
        else:
            calls[event.index].arguments += event.text
    return ExtractedToolCalls("".join(content), calls)


def marker_prefix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker`` (to hold back)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class _ContentOut:
    """Content text with the whitespace rule: whitespace touching tool-call markup is dropped."""

    def __init__(self, events: list[Event]) -> None:
        self.events = events
        self.pending_ws = ""
        self.skip_leading = False

    def emit(self, text: str) -> None:
        if self.skip_leading:
            text = text.lstrip()
            if not text:
                return
            self.skip_leading = False
        body = text.rstrip()
        if body:
            self.events.append(ContentText(self.pending_ws + body))
            self.pending_ws = ""
        self.pending_ws += text[len(body) :]

    def call_started(self) -> None:
        self.pending_ws = ""

    def call_ended(self) -> None:
        self.skip_leading = True

    def finish(self, made_calls: bool) -> None:
        if self.pending_ws and not made_calls:
            self.events.append(ContentText(self.pending_ws))
        self.pending_ws = ""


class ToolParser(ABC):
    """One completion's incremental tool-call parser; make a new one per choice.

    ``feed(delta)`` returns the events the new text decides; ``finish()`` those the end of the text
    decides. ``special_markers`` are markup strings that tokenizers usually mark as special tokens:
    the serving layer keeps special tokens in the text when one of them is (so the parser sees them).
    """

    name: ClassVar[str]
    special_markers: ClassVar[tuple[str, ...]] = ()
    # Markers after which the model waits for the tool's result (harmony's ``<|call|>``): the serving
    # layer stops generation at them when they are single tokens.
    stop_markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._events: list[Event] = []
        self._content = _ContentOut(self._events)
        self.num_calls = 0
        self._finished = False
        # The call being read.
        self._reader: ToolCallObjectReader | None = None
        self._held = ""  # raw text of a call not yet committed, released as content if it fails
        self._open = False  # a committed call is open
        self._args_sent = False
        self._pending_args = ""

    # ------------------------------------------------------------------ public API

    def feed(self, text: str) -> list[Event]:
        """Events decided by ``text``, the next piece of the completion."""
        if self._finished:
            raise RuntimeError("feed after finish")
        self._parse(text)
        return self._take()

    def finish(self) -> list[Event]:
        """Events decided by the end of the completion; the parser cannot be fed afterwards."""
        if not self._finished:
            self._finished = True
            self._parse_end()
            self._content.finish(self.num_calls > 0)
        return self._take()

    def extract(self, text: str) -> ExtractedToolCalls:
        """Non-streaming: the whole completion's content and tool calls (on a fresh parser)."""
        return fold_events(self.feed(text) + self.finish())

    # ------------------------------------------------------------------ format hooks

    @abstractmethod
    def _parse(self, text: str) -> None:
        """Consume ``text``, calling the helpers below."""

    @abstractmethod
    def _parse_end(self) -> None:
        """The text ended: release or close whatever is pending."""

    # ------------------------------------------------------------------ helpers for formats

    def _take(self) -> list[Event]:
        events = list(self._events)
        self._events.clear()
        return events

    def _emit_content(self, text: str) -> None:
        if text:
            self._content.emit(text)

    def _commit(self, name: str) -> None:
        """Start a call named ``name``: its header goes out now."""
        self._content.call_started()
        self._events.append(ToolCallStart(self.num_calls, new_call_id(), name))
        self._open, self._args_sent, self._held = True, False, ""
        if self._pending_args:
            self._emit_args(self._pending_args)
            self._pending_args = ""

    def _emit_args(self, text: str) -> None:
        if not text:
            return
        if not self._open:  # arguments written before the name: held until the name is known
            self._pending_args += text
            return
        self._args_sent = True
        self._events.append(ToolCallArguments(self.num_calls, text))

    def _close_call(self) -> None:
        """End the committed call (``{}`` if it never got arguments)."""
        if not self._args_sent:
            self._events.append(ToolCallArguments(self.num_calls, "{}"))
        self.num_calls += 1
        self._open = False
        self._content.call_ended()

    def _release_held(self, rest: str = "") -> None:
        """The uncommitted call was not one: its raw text (and ``rest``) is content after all."""
        held, self._held, self._pending_args = self._held, "", ""
        self._reader = None
        self._emit_content(held + rest)

    def _start_object(self, held: str) -> None:
        """A ``{"name": ..., "arguments": ...}`` object starts; ``held`` is markup already consumed."""
        self._reader = ToolCallObjectReader()
        self._held = held
        self._pending_args = ""

    def _feed_object(self, text: str) -> tuple[int, str]:
        """Feed the open object; returns (characters consumed, status): ``open``, ``ended`` or ``failed``.

        ``ended`` covers a committed call whose object closed or broke off (the call stands);
        ``failed`` a call that broke off before its name was known (its text became content).
        """
        reader = self._reader
        assert reader is not None
        events, consumed = reader.feed(text)
        if not self._open:
            self._held += text[:consumed]
        return consumed, self._apply_object_events(events)

    def _finish_object(self) -> None:
        """The text ended inside an object: keep a committed call, release an uncommitted one."""
        reader = self._reader
        assert reader is not None
        status = self._apply_object_events(reader.finish())
        if status == "open":
            if self._open:
                self._close_call()
            else:
                self._release_held()
        self._reader = None

    def _apply_object_events(self, events: list[Any]) -> str:
        for event in events:
            if event.kind == "name":
                self._commit(event.text)
            elif event.kind == "arguments":
                self._emit_args(event.text)
            elif self._open:  # "end", or "error" after the name: the call stands
                self._close_call()
                self._reader = None
                return "ended"
            else:
                self._release_held()
                return "failed"
        return "open"
