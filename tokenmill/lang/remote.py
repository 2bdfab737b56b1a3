"""What the two HTTP backends share: a client, SSE reading, and a local copy of the tokenizer
(a remote server does not send its chat template, so role blocks and tool rounds are rendered here)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
from transformers import PreTrainedTokenizerBase

from tokenmill.frontend.tool_parsers import detect_tool_parser
from tokenmill.lang.backend import Backend, ChatTurns
from tokenmill.lang.chat_roles import ChatRoles


class RemoteError(ValueError):
    """The server refused or failed a request; the message carries its status and error text."""


def check_response(response: httpx.Response, what: str) -> None:
    if response.status_code >= 400:
        response.read()
        raise RemoteError(f"{what} failed with HTTP {response.status_code}: {response.text[:500]}")


def sse_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The JSON objects of a ``data: ...`` event stream, up to ``data: [DONE]``."""
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            return
        event = json.loads(payload)
        if isinstance(event, dict) and "error" in event:
            raise RemoteError(f"the server failed the stream: {event['error']}")
        yield event


class RemoteBackend(Backend):
    """Base of ``Endpoint`` and ``OpenAIEndpoint``: HTTP client and a lazily loaded local tokenizer."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        tokenizer: str | PreTrainedTokenizerBase | None,
        timeout: float,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self._tokenizer_spec = tokenizer
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._lock = threading.Lock()
        self._roles = ChatRoles(lambda messages: self._render(messages, add_generation_prompt=False))

    def model_name(self) -> str:
        """The served model's name or path (what the local tokenizer is loaded from by default)."""
        raise NotImplementedError

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        with self._lock:
            if self._tokenizer is None:
                spec = self._tokenizer_spec if self._tokenizer_spec is not None else self.model_name()
                self._tokenizer = load_tokenizer(spec)
            return self._tokenizer

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, **kwargs: Any) -> str:
        tokenizer = self.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the model has no chat template; role blocks and tools need one")
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
        assert isinstance(text, str)
        return text

    def chat_roles(self) -> ChatRoles:
        return self._roles

    def render_chat(self, turns: ChatTurns) -> str:
        return self._render(turns.messages, add_generation_prompt=True, tools=turns.tools or None)

    def chat_template_source(self) -> str | None:
        source = getattr(self.tokenizer, "chat_template", None)
        return source if isinstance(source, str) else None

    def tool_parser_name(self) -> str | None:
        return detect_tool_parser(self.chat_template_source())

    def close(self) -> None:
        self.http.close()


def load_tokenizer(spec: str | PreTrainedTokenizerBase | Callable[[], PreTrainedTokenizerBase]) -> Any:
    """A tokenizer from an object, a bundled alias, a local folder or a Hugging Face name."""
    if isinstance(spec, PreTrainedTokenizerBase):
        return spec
    if callable(spec):
        return spec()
    from tokenmill.loader import resolve_model

    try:
        return resolve_model(spec).load_tokenizer()
    except Exception as exc:
        raise ValueError(
            f"cannot load the tokenizer {spec!r} locally (role blocks and tools render the chat template "
            f"here); pass tokenizer= (a path, an alias or a tokenizer): {exc}"
        ) from exc
