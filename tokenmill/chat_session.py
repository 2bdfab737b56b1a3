"""A multi-turn chat over the offline engine, used by ``tokenmill chat``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tokenmill.llm import LLM
from tokenmill.sampling_params import SamplingParams


class ChatSession:
    """Keeps the conversation and streams each reply; the reply is added to the history once done."""

    def __init__(
        self, model: str, params: SamplingParams, system: str | None = None, **engine_kwargs: Any
    ) -> None:
        self.llm = LLM(model, **engine_kwargs)
        self.params = params
        self.messages: list[dict[str, Any]] = []
        if system:
            self.messages.append({"role": "system", "content": system})

    def send(self, user_text: str) -> Iterator[str]:
        self.messages.append({"role": "user", "content": user_text})
        text = self.llm.input_processor.render_chat(self.messages)
        token_ids = self.llm.input_processor.tokenize(text, add_special_tokens=False)
        reply: list[str] = []
        for piece in self.llm.stream({"prompt": text, "prompt_token_ids": token_ids}, self.params):
            reply.append(piece)
            yield piece
        self.messages.append({"role": "assistant", "content": "".join(reply)})
