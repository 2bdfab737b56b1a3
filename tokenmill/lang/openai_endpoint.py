"""``OpenAIEndpoint``: any OpenAI-compatible server through ``/v1/completions``.

The state's text is the prompt (role blocks are rendered locally with the model's chat template).
``select`` needs prompt logprobs: ``echo`` with ``logprobs`` and ``max_tokens: 0`` on completions
(tokenmill, legacy OpenAI); a server without them fails ``select`` with an error that says so.
Constraints go as vLLM's ``structured_outputs`` field, which tokenmill and vLLM read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from tokenmill.lang.backend import (
    CallResult,
    ChoiceScores,
    TextCallback,
    check_choices,
    choice_span,
    normalized_logprob,
)
from tokenmill.lang.expr import Gen
from tokenmill.lang.remote import RemoteBackend, RemoteError, check_response, sse_events


def _usage(body: dict[str, Any]) -> tuple[int, int, int]:
    usage = body.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return (
        int(usage.get("prompt_tokens", 0)),
        int(usage.get("completion_tokens", 0)),
        int(details.get("cached_tokens", 0) or 0),
    )


class OpenAIEndpoint(RemoteBackend):
    """``OpenAIEndpoint("http://host:8000/v1", api_key=None, model=None)``; ``model`` defaults to
    the first of ``/models``, and the tokenizer (for chat templates) to that name."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        model: str | None = None,
        tokenizer: str | PreTrainedTokenizerBase | None = None,
        timeout: float = 600.0,
    ) -> None:
        super().__init__(base_url, api_key, tokenizer, timeout)
        self._model = model

    def model_name(self) -> str:
        if self._model is None:
            response = self.http.get("/models")
            check_response(response, "GET /models")
            self._model = str(response.json()["data"][0]["id"])
        return self._model

    def _body(self, prompt: str | list[str], gen: Gen) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model_name(),
            "prompt": prompt,
            "max_tokens": gen.max_tokens,
            "temperature": gen.temperature,
            "top_p": gen.top_p,
        }
        if gen.top_k != -1:
            body["top_k"] = gen.top_k
        if gen.stop:
            body["stop"] = list(gen.stop)
        if gen.seed is not None:
            body["seed"] = gen.seed
        if gen.ignore_eos:
            body["ignore_eos"] = True
        if gen.regex is not None:
            body["structured_outputs"] = {"regex": gen.regex}
        elif gen.json_schema is not None:
            body["structured_outputs"] = {"json": gen.json_schema}
        return body

    def generate(self, prompt: str, gen: Gen, on_text: TextCallback | None = None) -> CallResult:
        body = self._body(prompt, gen)
        if on_text is None:
            response = self.http.post("/completions", json=body)
            check_response(response, "POST /completions")
            reply = response.json()
            choice = reply["choices"][0]
            prompt_tokens, completion_tokens, cached = _usage(reply)
            return CallResult(
                choice["text"], prompt_tokens, completion_tokens, cached, choice.get("finish_reason")
            )
        pieces: list[str] = []
        finish: str | None = None
        usage: dict[str, Any] = {}
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with self.http.stream("POST", "/completions", json=stream_body) as response:
            check_response(response, "POST /completions")
            for event in sse_events(response):
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        pieces.append(choice["text"])
                        on_text(choice["text"])
                    finish = choice.get("finish_reason") or finish
                if event.get("usage"):
                    usage = event
        prompt_tokens, completion_tokens, cached = _usage(usage)
        return CallResult("".join(pieces), prompt_tokens, completion_tokens, cached, finish)

    def score_choices(self, prompt: str, choices: Sequence[str]) -> ChoiceScores:
        options = check_choices(choices)
        body = {
            "model": self.model_name(),
            "prompt": [prompt, *(prompt + choice for choice in options)],
            "max_tokens": 0,
            "echo": True,
            "logprobs": 0,
            "temperature": 0,
        }
        response = self.http.post("/completions", json=body)
        if response.status_code >= 400:
            raise RemoteError(
                "select on an OpenAI-compatible server needs prompt logprobs (/v1/completions with echo=true, "
                f"logprobs and max_tokens=0); this server refused them with HTTP {response.status_code}: "
                f"{response.text[:300]}"
            )
        reply = response.json()
        by_index = sorted(reply["choices"], key=lambda c: c["index"])
        rows: list[tuple[list[str], list[float | None]]] = []
        for choice in by_index:
            logprobs = choice.get("logprobs") or {}
            if not logprobs.get("tokens"):
                raise RemoteError("select needs prompt logprobs, but the server's echo reply has none")
            rows.append((logprobs["tokens"], logprobs["token_logprobs"]))
        prompt_tokens = rows[0][0]
        token_logprobs = []
        for tokens, values in rows[1:]:
            start = choice_span(_as_ids(prompt_tokens, tokens)[0], _as_ids(prompt_tokens, tokens)[1])
            token_logprobs.append([float(v) for v in values[start:] if v is not None])
        prompt_count, _, cached = _usage(reply)
        call = CallResult("", prompt_count, 0, cached)
        return ChoiceScores([normalized_logprob(v) for v in token_logprobs], token_logprobs, call)

    def prime(self, prompt: str) -> CallResult:
        body = {**self._body(prompt, Gen(name=None, max_tokens=1)), "max_tokens": 0, "echo": True}
        response = self.http.post("/completions", json=body)
        if response.status_code >= 400:  # a server that refuses max_tokens 0: priming is an optimisation
            return CallResult("", 0, 0, 0)
        prompt_tokens, _, cached = _usage(response.json())
        return CallResult("", prompt_tokens, 0, cached, "length")


def _as_ids(a: list[str], b: list[str]) -> tuple[list[int], list[int]]:
    """Token texts as comparable ids (equal texts, equal ids) for ``choice_span``."""
    table: dict[str, int] = {}
    return [table.setdefault(t, len(table)) for t in a], [table.setdefault(t, len(table)) for t in b]
