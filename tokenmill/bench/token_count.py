"""Counting prompt tokens without the server's tokenizer in this process.

The benchmark client must work against any OpenAI-compatible server, whose tokenizer it does not
have. Two counters share one signature, ``(text) -> number of tokens``:

- ``estimate_tokens``: one token per word and per punctuation mark. Exact for the benchmark's own
  word prompts on common BPE tokenizers to within a few percent; for free text it is an estimate.
- ``ServerTokenCounter``: asks the server. tokenmill and vLLM serve ``POST /tokenize`` with
  ``{"prompt": ...}``; llama.cpp's llama-server serves it with ``{"content": ...}``. The first
  shape that answers is remembered. Special tokens (BOS) are not counted, so a prompt of N tokens
  reaches the model as N plus whatever the server adds.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import httpx

TokenCounter = Callable[[str], int]

_PIECE = re.compile(r"\w+|[^\w\s]")


def estimate_tokens(text: str) -> int:
    """Words plus punctuation marks in ``text``: a tokenizer-free stand-in for a token count."""
    return len(_PIECE.findall(text))


class TokenizeUnavailable(RuntimeError):
    """The server has no usable ``/tokenize`` endpoint."""


class ServerTokenCounter:
    """Counts tokens with the server's ``/tokenize``; construct with :meth:`connect`.

    Contract: ``__call__`` returns the number of tokens the server's tokenizer makes of ``text``
    without special tokens, or raises ``httpx.HTTPError`` / ``TokenizeUnavailable``.
    """

    def __init__(self, client: httpx.Client, model: str | None, style: str) -> None:
        self._client = client
        self._model = model
        self._style = style

    @classmethod
    def connect(cls, client: httpx.Client, model: str | None) -> ServerTokenCounter:
        """Probe the server's ``/tokenize`` shapes; raise ``TokenizeUnavailable`` if none answers."""
        reasons = []
        for style in ("openai", "llamacpp"):
            counter = cls(client, model, style)
            try:
                if counter("hello world") > 0:
                    return counter
                reasons.append(f"{style}: zero tokens for 'hello world'")
            except (httpx.HTTPError, TokenizeUnavailable, ValueError) as exc:
                reasons.append(f"{style}: {exc}")
        raise TokenizeUnavailable("; ".join(reasons))

    def _body(self, text: str) -> dict[str, Any]:
        if self._style == "openai":
            body: dict[str, Any] = {"prompt": text, "add_special_tokens": False}
            if self._model is not None:
                body["model"] = self._model
            return body
        return {"content": text, "add_special": False}

    def __call__(self, text: str) -> int:
        response = self._client.post("/tokenize", json=self._body(text))
        if response.status_code != 200:
            raise TokenizeUnavailable(f"/tokenize answered HTTP {response.status_code}")
        payload = response.json()
        if isinstance(payload.get("count"), int):
            return int(payload["count"])
        if isinstance(payload.get("tokens"), list):
            return len(payload["tokens"])
        raise TokenizeUnavailable("/tokenize reply has neither 'count' nor 'tokens'")
