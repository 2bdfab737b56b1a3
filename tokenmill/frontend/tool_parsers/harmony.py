"""gpt-oss tool calls in the harmony format: a ``commentary`` message addressed to ``functions.NAME``
whose body is the arguments JSON, ended by ``<|call|>``::

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

Messages without a recipient are content (their bodies, markup removed); the harmony reasoning parser
(``--reasoning-parser openai_gptoss``) takes the ``analysis`` channel out before this parser reads the
text, and passes messages to tools on verbatim. The arguments are the body's exact characters; a
message to a recipient outside ``functions.`` (a built-in tool such as ``browser.search``) is not a
function call and is dropped rather than shown as content.
"""

from __future__ import annotations

from tokenmill.frontend.harmony import CALL, CHANNEL, MESSAGE, TERMINATORS, HarmonyEvent, HarmonyStream
from tokenmill.frontend.tool_parsers.base import ToolParser

FUNCTIONS = "functions."


class HarmonyToolParser(ToolParser):
    name = "openai"
    special_markers = (CHANNEL, MESSAGE, *TERMINATORS)
    stop_markers = (CALL,)  # gpt-oss's config lists only <|return|> as EOS; a call must end the turn too

    def __init__(self) -> None:
        super().__init__()
        self._stream = HarmonyStream()
        self._route = "content"  # the open message's body: content | arguments | dropped

    def _parse(self, text: str) -> None:
        self._apply(self._stream.feed(text))

    def _parse_end(self) -> None:
        self._apply(self._stream.finish())
        if self._open:  # cut off inside the arguments: the committed call stands
            self._close_call()

    def _apply(self, events: list[HarmonyEvent]) -> None:
        for event in events:
            if event.kind == "header":
                recipient = event.recipient
                if recipient is None:
                    self._route = "content"
                elif recipient.startswith(FUNCTIONS) and len(recipient) > len(FUNCTIONS):
                    self._route = "arguments"
                    self._commit(recipient[len(FUNCTIONS) :])
                else:
                    self._route = "dropped"
            elif event.kind == "body":
                if self._route == "arguments":
                    self._emit_args(event.text)
                elif self._route == "content":
                    self._emit_content(event.text)
            elif self._route == "arguments":
                self._close_call()
                self._route = "content"
