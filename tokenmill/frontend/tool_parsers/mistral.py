"""Mistral tool calls, both generations of the format.

- Older models (tokenizer v3): ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.
- Newer ones (tokenizer v11+): ``[TOOL_CALLS]name[ARGS]{...}``, repeated for each call.

``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens, so the serving layer keeps special tokens in the
text for this parser. Content may come before the first ``[TOOL_CALLS]``.
"""

from __future__ import annotations

import re

from tokenmill.frontend.tool_parsers.base import ToolParser, marker_prefix_len
from tokenmill.frontend.tool_parsers.json_scan import JsonValueScanner

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,256}")


class MistralToolParser(ToolParser):
    name = "mistral"
    special_markers = (TOOL_CALLS, ARGS)

    def __init__(self) -> None:
        super().__init__()
        # content | marker | array_item | object | array_sep | name | args | after
        self._state = "content"
        self._buffer = ""
        self._args: JsonValueScanner | None = None
        self._scalar_args = ""

    def _parse(self, text: str) -> None:
        self._buffer += text
        while self._buffer:
            if not self._step():
                return

    def _step(self) -> bool:
        """Advance on the buffer; False when more text is needed."""
        buffer, state = self._buffer, self._state
        if state == "content":
            at = buffer.find(TOOL_CALLS)
            if at < 0:
                keep = marker_prefix_len(buffer, TOOL_CALLS)
                self._emit_content(buffer[: len(buffer) - keep])
                self._buffer = buffer[len(buffer) - keep :]
                return False
            self._emit_content(buffer[:at])
            self._buffer, self._state, self._held = buffer[at + len(TOOL_CALLS) :], "marker", TOOL_CALLS
        elif state == "marker":  # after [TOOL_CALLS]: a JSON array, or a function name
            stripped = buffer.lstrip()
            if not stripped:
                self._held, self._buffer = self._held + buffer, ""
                return False
            if stripped[0] == "[":
                self._buffer, self._state, self._held = stripped[1:], "array_item", ""
            else:
                self._held += buffer[: len(buffer) - len(stripped)]
                self._buffer, self._state = stripped, "name"
        elif state == "array_item":
            stripped = buffer.lstrip()
            if not stripped:
                self._buffer = ""
                return False
            if stripped[0] != "{":
                return self._to_content(stripped)
            self._start_object("")
            self._buffer, self._state = stripped, "object"
        elif state == "object":
            consumed, status = self._feed_object(buffer)
            self._buffer = buffer[consumed:]
            if status == "open":
                return False
            self._state = "array_sep" if status == "ended" else "content"
        elif state == "array_sep":
            stripped = buffer.lstrip()
            if not stripped:
                self._buffer = ""
                return False
            if stripped[0] == ",":
                self._buffer, self._state = stripped[1:], "array_item"
            elif stripped[0] == "]":
                self._buffer, self._state = stripped[1:], "after"
            else:
                return self._to_content(stripped)
        elif state == "name":
            at = buffer.find(ARGS)
            name = buffer[:at] if at >= 0 else buffer[: len(buffer) - marker_prefix_len(buffer, ARGS)]
            name = name.rstrip()  # a space may come before [ARGS] (tokenizers that join tokens with one)
            if (name or at >= 0) and not _NAME.fullmatch(name):
                return self._release_marker()  # not a call after all: the marker and text are content
            if at < 0:
                return False
            self._commit(name)
            self._buffer, self._state = buffer[at + len(ARGS) :].lstrip(), "args"
            self._args, self._scalar_args = JsonValueScanner(), ""
        elif state == "args":
            scanner = self._args
            assert scanner is not None
            if scanner.first is None:  # whitespace before the value is not part of it
                buffer = self._buffer = buffer.lstrip()
                if not buffer:
                    return False
            taken = 0
            for ch in buffer:
                if not scanner.push(ch):
                    break
                taken += 1
                if scanner.done:
                    break
            piece = buffer[:taken]
            if scanner.first in ("{", "["):
                self._emit_args(piece)
            else:
                self._scalar_args += piece
            self._buffer = buffer[taken:]
            if not scanner.done:
                return False
            self._end_args()
        else:  # after a call: another [TOOL_CALLS], or content
            stripped = buffer.lstrip()
            if not stripped:
                self._buffer = ""
                return False
            if TOOL_CALLS.startswith(stripped[: len(TOOL_CALLS)]) and len(stripped) < len(TOOL_CALLS):
                self._buffer = stripped
                return False
            if stripped.startswith(TOOL_CALLS):
                self._buffer, self._state, self._held = stripped[len(TOOL_CALLS) :], "marker", TOOL_CALLS
            else:
                return self._to_content(stripped)
        return True

    def _release_marker(self) -> bool:
        held, self._held = self._held, ""
        self._state = "content"
        # The buffer is searched again for a marker, so a real call later in the text is still found.
        self._emit_content(held)
        return True

    def _to_content(self, text: str) -> bool:
        self._state, self._buffer = "content", text
        return True

    def _end_args(self) -> None:
        if self._scalar_args:
            self._emit_args(self._scalar_args)
        self._args, self._scalar_args = None, ""
        self._close_call()
        self._state = "after"

    def _parse_end(self) -> None:
        if self._state == "content":
            self._emit_content(self._buffer)
        elif self._state in ("marker", "name"):
            self._emit_content(self._held + self._buffer)
        elif self._state == "object":
            self._finish_object()
        elif self._state == "args":
            assert self._args is not None
            self._args.finish_scalar()
            self._end_args()
        self._buffer = self._held = ""
