"""``Endpoint``: a tokenmill (or SGLang) server through its native ``/generate`` API.

Requests follow SGLang's protocol: ``text`` (a string or a list), ``sampling_params``
(``max_new_tokens``, ``stop``, ``temperature``, ``regex``, ``json_schema``...), ``return_logprob`` with
``logprob_start_len``; replies carry ``meta_info`` (``prompt_tokens``, ``completion_tokens``,
``cached_tokens``, ``finish_reason``, ``input_token_logprobs`` as ``[logprob, token_id, text]``).
Streaming replies are server-sent events whose ``text`` is cumulative. ``select`` tokenizes here
with the served model's tokenizer and sends ``input_ids`` with a ``logprob_start_len`` per choice.
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
    encode_text,
    normalized_logprob,
)
from tokenmill.lang.expr import Gen
from tokenmill.lang.remote import RemoteBackend, RemoteError, check_response, sse_events


def native_sampling_params(gen: Gen) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_new_tokens": gen.max_tokens,
        "temperature": gen.temperature,
        "top_p": gen.top_p,
        "top_k": gen.top_k,
        "ignore_eos": gen.ignore_eos,
    }
    if gen.stop:
        params["stop"] = list(gen.stop)
    if gen.regex is not None:
        params["regex"] = gen.regex
    if gen.json_schema is not None:
        params["json_schema"] = gen.json_schema
    if gen.seed is not None:
        params["sampling_seed"] = gen.seed
    return params


def finish_reason_of(meta: dict[str, Any]) -> str | None:
    """SGLang reports ``{"type": "stop" | "length" | "abort", ...}``; older servers a plain string."""
    reason = meta.get("finish_reason")
    if isinstance(reason, dict):
        return reason.get("type")
    return reason


def _call_result(reply: dict[str, Any]) -> CallResult:
    meta = reply.get("meta_info", {})
    return CallResult(
        text=reply.get("text", ""),
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        completion_tokens=int(meta.get("completion_tokens", 0)),
        cached_tokens=int(meta.get("cached_tokens", 0) or 0),
        finish_reason=finish_reason_of(meta),
    )


class Endpoint(RemoteBackend):
    """``Endpoint("http://localhost:8000", api_key=None)``; ``tokenizer`` defaults to the model the
    server names in ``/get_model_info``, loaded locally for chat templates."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        tokenizer: str | PreTrainedTokenizerBase | None = None,
        timeout: float = 600.0,
    ) -> None:
        super().__init__(base_url, api_key, tokenizer, timeout)
        self._model_info: dict[str, Any] | None = None

    def model_name(self) -> str:
        if self._model_info is None:
            response = self.http.get("/get_model_info")
            check_response(response, "GET /get_model_info")
            self._model_info = response.json()
        return str(self._model_info.get("tokenizer_path") or self._model_info["model_path"])

    def _post(self, body: dict[str, Any]) -> Any:
        response = self.http.post("/generate", json=body)
        check_response(response, "POST /generate")
        return response.json()

    def generate(self, prompt: str, gen: Gen, on_text: TextCallback | None = None) -> CallResult:
        body = {"text": prompt, "sampling_params": native_sampling_params(gen)}
        if on_text is None:
            return _call_result(self._post(body))
        last: dict[str, Any] = {}
        sent = 0
        with self.http.stream("POST", "/generate", json={**body, "stream": True}) as response:
            check_response(response, "POST /generate")
            for event in sse_events(response):
                text = event.get("text", "")
                if len(text) > sent:
                    on_text(text[sent:])
                    sent = len(text)
                last = event
        if not last:
            raise RemoteError("POST /generate streamed no reply")
        return _call_result(last)

    def score_choices(self, prompt: str, choices: Sequence[str]) -> ChoiceScores:
        """Tokenize here (with the served model's tokenizer), prime the prompt for two or more
        choices, then score all choices in one prompt-only batch whose logprobs start at each choice
        (``logprob_start_len``), so the server takes the prompt from its prefix cache."""
        options = check_choices(choices)
        prompt_ids = encode_text(self.tokenizer, prompt)
        fulls = [encode_text(self.tokenizer, prompt + choice) for choice in options]
        starts = [choice_span(prompt_ids, full) for full in fulls]
        metas = []
        if len(options) > 1:
            metas.append(
                self._post({"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 0}})["meta_info"]
            )
        body = {
            "input_ids": fulls,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": starts,
        }
        replies = self._post(body)
        if not isinstance(replies, list) or len(replies) != len(options):
            raise RemoteError(
                f"POST /generate answered a batch of {len(options)} prompts with {replies!r:.200}"
            )
        token_logprobs = []
        for reply, full, start in zip(replies, fulls, starts):
            row = reply["meta_info"]["input_token_logprobs"]
            if [int(entry[1]) for entry in row] != full[start:]:
                raise RemoteError("POST /generate returned input logprobs for other tokens than were sent")
            token_logprobs.append([float(entry[0]) for entry in row])
        metas += [reply.get("meta_info", {}) for reply in replies]
        call = CallResult(
            text="",
            prompt_tokens=sum(int(m.get("prompt_tokens", 0)) for m in metas),
            completion_tokens=0,
            cached_tokens=sum(int(m.get("cached_tokens", 0) or 0) for m in metas),
        )
        return ChoiceScores([normalized_logprob(v) for v in token_logprobs], token_logprobs, call)

    def prime(self, prompt: str) -> CallResult:
        return _call_result(self._post({"text": prompt, "sampling_params": {"max_new_tokens": 0}}))

    def flush_cache(self) -> None:
        """Drop the server's prefix cache (``POST /flush_cache``)."""
        check_response(self.http.post("/flush_cache"), "POST /flush_cache")
