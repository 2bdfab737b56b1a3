"""Parsers for tool choices a grammar enforces, so the output is known JSON rather than free markup.

- A named function (``tool_choice: {"type": "function", "function": {"name": ...}}``): the whole
  output is the arguments object; the call's header goes out with the first text.
- ``tool_choice: "required"``: the output is ``[{"name": ..., "parameters": {...}}, ...]``, read with
  the same array reader as Mistral's older format.
"""

from __future__ import annotations

from tokenmill.frontend.tool_parsers.base import ToolParser
from tokenmill.frontend.tool_parsers.mistral import MistralToolParser


class NamedToolParser(ToolParser):
    name = "named"

    def __init__(self, function_name: str) -> None:
        super().__init__()
        self.function_name = function_name
        self._started = False

    def _parse(self, text: str) -> None:
        if not self._open:
            self._commit(self.function_name)
        if not self._started:  # whitespace before the object is not part of the arguments
            text = text.lstrip()
            self._started = bool(text)
        self._emit_args(text)

    def _parse_end(self) -> None:
        if not self._open:
            self._commit(self.function_name)
        self._close_call()


class RequiredToolParser(MistralToolParser):
    name = "required"

    def __init__(self) -> None:
        super().__init__()
        self._state = "marker"  # straight to "an array or a name", with no [TOOL_CALLS] before it
