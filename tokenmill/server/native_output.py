"""The SGLang-native response of one output: ``{"text", "output_ids", "meta_info"}``.

``meta_info`` carries ``id``, ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``,
``finish_reason`` (``{"type": "stop", "matched": <token id or stop string>}``,
``{"type": "length", "length": <tokens>}`` or ``{"type": "abort", "message": ...}``; null while
running), ``weight_version``, ``e2e_latency`` once finished and, with ``return_logprob``, the
logprob lists. A logprob entry is ``[logprob, token_id, text]`` (text null unless
``return_text_in_logprobs``); a top-logprobs position is a list of such entries, best first.
``input_token_logprobs[k]`` is prompt token ``logprob_start_len + k`` given the tokens before it,
null for prompt position 0, which has nothing before it. With the default ``logprob_start_len`` of
-1 (output logprobs only), SGLang's shape is kept: one null entry for the last prompt token, or none
for a prompt-only request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.frontend.output_processor import RequestState, SampleState
from tokenmill.outputs import PositionLogprobDict
from tokenmill.server.logprobs import logprob_value, top_candidates

LogprobEntry = list[Any]  # [logprob or None, token_id, text or None]


@dataclass
class LogprobOptions:
    """What one prompt of a ``/generate`` request asked for."""

    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text: bool = False


@dataclass
class OutputShaper:
    """Builds response dicts for the outputs of one request; ``token_text`` decodes one token id."""

    token_text: Any  # Callable[[int], str]
    weight_version: str

    def response(
        self, state: RequestState, sample: SampleState, output_id: str, options: LogprobOptions
    ) -> dict[str, Any]:
        """The whole answer for ``sample`` as it stands (text and ids cumulative)."""
        meta: dict[str, Any] = {
            "id": output_id,
            "finish_reason": finish_reason_json(sample),
            "prompt_tokens": len(state.prompt_token_ids),
            "completion_tokens": len(sample.token_ids),
            "cached_tokens": state.num_cached_tokens,
            "weight_version": self.weight_version,
            # Per output token, the weight version that produced it (RL: a trainer masks tokens
            # sampled before an update as off-policy).
            "output_token_weight_versions": list(sample.weight_versions),
        }
        if options.return_logprob:
            meta.update(self._logprobs(state, sample, options))
        if sample.finish_reason is not None:
            end = state.finished_time if state.finished_time is not None else state.last_token_time
            meta["e2e_latency"] = max(0.0, (end or state.arrival_time) - state.arrival_time)
        return {"text": sample.text, "output_ids": list(sample.token_ids), "meta_info": meta}

    def _entry(self, logprob: float | None, token_id: int, with_text: bool) -> LogprobEntry:
        return [logprob, token_id, self.token_text(token_id) if with_text else None]

    def _top(self, position: PositionLogprobDict, options: LogprobOptions) -> list[LogprobEntry]:
        return [
            self._entry(logprob_value(lp), token_id, options.return_text)
            for token_id, lp in top_candidates(position, options.top_logprobs_num)
        ]

    def _logprobs(self, state: RequestState, sample: SampleState, options: LogprobOptions) -> dict[str, Any]:
        positions = sample.logprobs or []
        output_entries = [
            self._entry(logprob_value(position[token_id]), token_id, options.return_text)
            for token_id, position in zip(sample.token_ids, positions)
        ]
        input_entries, input_top = self._input_logprobs(state, sample, options)
        result: dict[str, Any] = {
            "input_token_logprobs": input_entries,
            "output_token_logprobs": output_entries,
        }
        if options.top_logprobs_num > 0:
            result["input_top_logprobs"] = input_top
            result["output_top_logprobs"] = [
                self._top(position, options) for position in positions[: len(sample.token_ids)]
            ]
        return result

    def _input_logprobs(
        self, state: RequestState, sample: SampleState, options: LogprobOptions
    ) -> tuple[list[LogprobEntry], list[list[LogprobEntry] | None]]:
        prompt = state.prompt_token_ids
        if options.logprob_start_len < 0:
            if state.params.max_tokens == 0:
                return [], []
            return [self._entry(None, prompt[-1], options.return_text)], [None]
        if state.prompt_logprobs is None:
            return [], []  # not computed yet: they come with the first output token
        entries: list[LogprobEntry] = []
        tops: list[list[LogprobEntry] | None] = []
        for index in range(options.logprob_start_len, len(prompt)):
            token_id = prompt[index]
            position = state.prompt_logprobs[index] if index < len(state.prompt_logprobs) else None
            if position is None:
                entries.append(self._entry(None, token_id, options.return_text))
                tops.append(None)
            else:
                entries.append(self._entry(logprob_value(position[token_id]), token_id, options.return_text))
                tops.append(self._top(position, options))
        return entries, tops


def finish_reason_json(sample: SampleState) -> dict[str, Any] | None:
    """SGLang's finish reason object for a sample, or None while it runs."""
    reason = sample.finish_reason
    if reason is None:
        return None
    if reason == "stop":
        matched: int | str | None = sample.stop_reason
        if matched is None and sample.token_ids:
            matched = sample.token_ids[-1]  # an end-of-sequence token
        return {"type": "stop", "matched": matched}
    if reason == "length":
        return {"type": "length", "length": len(sample.token_ids)}
    if reason == "abort":
        return {"type": "abort", "message": "the request was aborted"}
    if reason == "timeout":
        return {"type": "abort", "message": "the request passed its deadline"}
    return {"type": "abort", "message": f"the request ended with {reason!r}"}
