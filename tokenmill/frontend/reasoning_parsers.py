"""Reasoning parsers: split a thinking model's output into ``reasoning_content`` and ``content``.

DeepSeek-R1 and Qwen3 think between ``<think>`` and ``</think>``. Templates differ in who writes
the opening tag: some prompts end with ``<think>`` already (the output then starts inside the
reasoning and only ``</think>`` appears), others leave it to the model. ``prompt_opened`` says which;
the serving layer sets it from the rendered prompt. The two registered names differ only in the
default when neither the prompt nor the output opens a block:

- ``deepseek_r1``: the model always reasons first, so text up to ``</think>`` is reasoning even
  without an opening tag (and all of it if the tag never comes).
- ``qwen3``: no opening tag means thinking is off (``enable_thinking=False``): all text is content.

gpt-oss writes the harmony format instead (``frontend/harmony.py``): ``openai_gptoss`` (vLLM's name;
``gpt_oss`` is an alias) takes the ``analysis`` channel as reasoning and the ``final`` channel and
recipient-less ``commentary`` (preambles) as content; messages addressed to a tool are passed on in the
content verbatim, markup included, for the harmony tool parser to read.

Like the tool parsers, one state machine serves streaming and non-streaming: ``parse(text)`` is
``feed(text)`` plus ``finish()``, so any split of the text gives the same two strings.
"""

from __future__ import annotations

from typing import ClassVar

from tokenmill.frontend.harmony import CHANNEL, MESSAGE, TERMINATORS, HarmonyEvent, HarmonyStream
from tokenmill.frontend.tool_parsers.base import marker_prefix_len

THINK_START = "<think>"
THINK_END = "</think>"


class ThinkReasoningParser:
    """One completion's reasoning splitter. ``feed`` returns ``(reasoning_delta, content_delta)``."""

    name = "think"
    implicit_start = False  # reasoning first even without <think> (DeepSeek-R1)
    # Markers that tokenizers may mark special: the serving layer then keeps special tokens in the text.
    special_markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, prompt_opened: bool = False) -> None:
        # start: undecided whether the output opens a block | reasoning | content
        self._state = "reasoning" if prompt_opened else "start"
        self._buffer = ""
        self._strip_next = prompt_opened  # leading whitespace of a channel is dropped
        self._reasoning_ws = ""  # trailing whitespace of the reasoning, dropped if </think> follows
        self.saw_reasoning = False

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._buffer:
            buffer = self._buffer
            if self._state == "start":
                stripped = buffer.lstrip()
                if not stripped or (THINK_START.startswith(stripped) and stripped != THINK_START):
                    return "".join(reasoning), "".join(content)  # maybe <think>, not complete yet
                if stripped.startswith(THINK_START):
                    self._buffer, self._state = stripped[len(THINK_START) :], "reasoning"
                else:
                    self._state = "reasoning" if self.implicit_start else "content"
                self._strip_next = True
            elif self._state == "reasoning":
                at = buffer.find(THINK_END)
                if at < 0:
                    keep = marker_prefix_len(buffer, THINK_END)
                    reasoning.append(self._reasoning_text(buffer[: len(buffer) - keep]))
                    self._buffer = buffer[len(buffer) - keep :]
                    break
                reasoning.append(self._reasoning_text(buffer[:at]))
                self._reasoning_ws = ""
                self._buffer, self._state, self._strip_next = buffer[at + len(THINK_END) :], "content", True
            else:
                content.append(self._channel_text(buffer))
                self._buffer = ""
        return self._seen("".join(reasoning)), "".join(content)

    def finish(self) -> tuple[str, str]:
        """Release what was held back at the end of the text."""
        rest, self._buffer = self._buffer, ""
        if self._state == "reasoning":
            return self._seen(self._reasoning_text(rest) + self._reasoning_ws), ""
        if self._state == "start":  # only whitespace or a partial "<think": it is content
            return "", rest
        return "", self._channel_text(rest)

    def parse(self, text: str) -> tuple[str, str]:
        """Non-streaming: ``(reasoning, content)`` of the whole output (on a fresh parser)."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return r1 + r2, c1 + c2

    def _channel_text(self, text: str) -> str:
        if self._strip_next:
            text = text.lstrip()
            self._strip_next = not text
        return text

    def _reasoning_text(self, text: str) -> str:
        text = self._channel_text(text)
        body = text.rstrip()
        if not body:
            self._reasoning_ws += text
            return ""
        out = self._reasoning_ws + body
        self._reasoning_ws = text[len(body) :]
        return out

    def _seen(self, reasoning: str) -> str:
        self.saw_reasoning = self.saw_reasoning or bool(reasoning)
        return reasoning


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    name = "deepseek_r1"
    implicit_start = True


class Qwen3ReasoningParser(ThinkReasoningParser):
    name = "qwen3"


class HarmonyReasoningParser(ThinkReasoningParser):
    """gpt-oss's harmony channels (module docstring): the same ``feed``/``finish``/``parse`` contract,
    read with ``HarmonyStream`` instead of ``<think>`` tags. ``prompt_opened`` is ignored: a harmony
    prompt ends with ``<|start|>assistant`` and the output names its channel."""

    name = "openai_gptoss"
    special_markers = (CHANNEL, MESSAGE, *TERMINATORS)

    def __init__(self, prompt_opened: bool = False) -> None:
        super().__init__(False)
        self._stream = HarmonyStream()
        self._route = "content"  # where the open message's body goes: reasoning | content | raw

    def feed(self, text: str) -> tuple[str, str]:
        return self._split(self._stream.feed(text))

    def finish(self) -> tuple[str, str]:
        return self._split(self._stream.finish())

    def _split(self, events: list[HarmonyEvent]) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        for event in events:
            if event.kind == "header":
                if event.recipient is not None:  # a tool call: verbatim, for the tool parser
                    self._route = "raw"
                    content.append(event.text + MESSAGE)
                else:
                    self._route = "reasoning" if event.channel == "analysis" else "content"
            elif event.kind == "body":
                (reasoning if self._route == "reasoning" else content).append(event.text)
            elif self._route == "raw":  # the end of a tool call's message
                content.append(event.text)
        return self._seen("".join(reasoning)), "".join(content)


REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
    "openai_gptoss": HarmonyReasoningParser,
    "gpt_oss": HarmonyReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ThinkReasoningParser]:
    """The parser class registered as ``name``; ValueError listing the known names otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}; known parsers: {known}") from None


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered chat prompt ends inside an open ``<think>`` block."""
    return prompt_text.rstrip().endswith(THINK_START)
