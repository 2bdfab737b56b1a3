"""Turns engine-core outputs (token ids) into text, applies stop strings, gathers n samples.

Shared by the offline LLM and the server. Stop strings live here, on the detokenizer side: when one
matches, the processor reports the sample's core request id so the caller aborts it in the core.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec
from transformers import PreTrainedTokenizerBase

from tokenmill.frontend.detokenizer import IncrementalDetokenizer
from tokenmill.frontend.processor import child_request_id
from tokenmill.frontend.stop_checker import StopStringChecker
from tokenmill.outputs import CompletionOutput, Logprob, PositionLogprobDict, RequestOutput
from tokenmill.protocol import EngineCoreOutput, FinishReason, PositionLogprobs
from tokenmill.sampling_params import SamplingParams


@dataclass
class SampleState:
    """One of a request's n samples as the client sees it: tokens, released text, logprobs."""

    index: int
    core_request_id: str
    detokenizer: IncrementalDetokenizer | None
    stop_checker: StopStringChecker
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[PositionLogprobDict] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # The weight version that produced each of token_ids (RL: a trainer masks off-policy tokens).
    weight_versions: list[str] = field(default_factory=list)
    # How much of token_ids / text / logprobs the streaming caller has already sent.
    sent_tokens: int = 0
    sent_text: int = 0
    sent_logprobs: int = 0

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            weight_versions=list(self.weight_versions),
        )


@dataclass
class RequestState:
    """A user request: its prompt, its samples, and timing for metrics."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    arrival_time: float
    prompt_logprobs: list[PositionLogprobDict | None] | None = None
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.completion() for s in self.samples],
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
        )


class OutputProcessor:
    """Keeps the state of every live request and applies core outputs to it.

    Contract: ``process`` returns the requests that changed this step and the core request ids to
    abort (samples stopped by a stop string). A request is dropped from the processor once all its
    samples have finished; ``abort`` ends every sample of a request with reason ``abort``.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._by_core_id: dict[str, tuple[RequestState, SampleState]] = {}
        self._token_text_cache: dict[int, str] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> RequestState:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        samples = []
        for i in range(params.n):
            detokenizer = (
                IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                )
                if params.detokenize
                else None
            )
            stop = params.stop if isinstance(params.stop, list) else []
            sample = SampleState(
                index=i,
                core_request_id=child_request_id(request_id, i, params.n),
                detokenizer=detokenizer,
                stop_checker=StopStringChecker(stop, params.include_stop_str_in_output),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            samples.append(sample)
        state = RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            samples=samples,
            arrival_time=time.time(),
        )
        self.requests[request_id] = state
        for sample in samples:
            self._by_core_id[sample.core_request_id] = (state, sample)
        return state

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestState], list[str]]:
        changed: dict[str, RequestState] = {}
        to_abort: list[str] = []
        now = time.time()
        for output in outputs:
            entry = self._by_core_id.get(output.request_id)
            if entry is None:
                continue  # aborted by the caller while the step ran
            state, sample = entry
            if sample.finish_reason is not None:
                continue
            if output.new_token_ids:  # a deadline can end a request that never produced a token
                if state.first_token_time is None:
                    state.first_token_time = now
                state.last_token_time = now
            state.num_cached_tokens = max(state.num_cached_tokens, output.num_cached_tokens)
            if output.prompt_logprobs is not None and state.prompt_logprobs is None:
                state.prompt_logprobs = [
                    None if p is None else self._logprob_dict(p) for p in output.prompt_logprobs
                ]
            self._apply_tokens(sample, output)
            if output.error is not None:
                sample.finish_reason = FinishReason.ERROR.value
            if sample.finish_reason is not None and output.finish_reason is None:
                to_abort.append(sample.core_request_id)  # a stop string ended it before the core did
            changed[state.request_id] = state
            if state.finished:
                self._drop(state, now)
        return list(changed.values()), to_abort

    def _apply_tokens(self, sample: SampleState, output: EngineCoreOutput) -> None:
        tokens = output.new_token_ids
        if len(tokens) > 1 and sample.detokenizer is not None and sample.stop_checker.has_stop_strings:
            # Several tokens at once (speculative decoding's accepted drafts, jump-forward): a stop
            # string ends the sample at the token that completes it, as with one token a step.
            for i, token in enumerate(tokens):
                last = i == len(tokens) - 1
                self._apply_tokens_at_once(
                    sample,
                    msgspec.structs.replace(
                        output,
                        new_token_ids=[token],
                        new_logprobs=None if output.new_logprobs is None else output.new_logprobs[i : i + 1],
                        finish_reason=output.finish_reason if last else None,
                        stop_reason=output.stop_reason if last else None,
                    ),
                )
                if sample.finish_reason is not None:
                    return
            return
        self._apply_tokens_at_once(sample, output)

    def _apply_tokens_at_once(self, sample: SampleState, output: EngineCoreOutput) -> None:
        sample.token_ids.extend(output.new_token_ids)
        sample.weight_versions += [output.weight_version or ""] * len(output.new_token_ids)
        if output.new_logprobs is not None and sample.logprobs is not None:
            for position in output.new_logprobs:
                sample.logprobs.append(self._logprob_dict(position))
                sample.cumulative_logprob = (sample.cumulative_logprob or 0.0) + position.logprobs[0]
        if sample.detokenizer is not None:
            delta = sample.detokenizer.push(output.new_token_ids)
            if output.finish_reason is not None:
                delta += sample.detokenizer.finish()
            checked = sample.stop_checker.process(delta)
            sample.text += checked.text
            if checked.stopped:
                sample.finish_reason = FinishReason.STOP.value
                sample.stop_reason = checked.stop
                return
        if output.finish_reason is not None:
            sample.text += sample.stop_checker.flush()
            sample.finish_reason = output.finish_reason.value
            sample.stop_reason = output.stop_reason

    def _logprob_dict(self, position: PositionLogprobs) -> PositionLogprobDict:
        result: PositionLogprobDict = {}
        for i, (token, value) in enumerate(zip(position.token_ids, position.logprobs)):
            if token in result:
                continue  # the chosen token can also appear among the top-N
            rank = position.rank if i == 0 else i
            result[token] = Logprob(logprob=value, rank=rank, decoded_token=self.token_text(token))
        return result

    def token_text(self, token_id: int) -> str:
        cached = self._token_text_cache.get(token_id)
        if cached is None:
            cached = str(self.tokenizer.decode([token_id]))
            self._token_text_cache[token_id] = cached
        return cached

    def abort(self, request_id: str) -> list[str]:
        """End every unfinished sample of ``request_id``; returns their core ids to abort."""
        state = self.requests.get(request_id)
        if state is None:
            return []
        ids = []
        for sample in state.samples:
            if sample.finish_reason is None:
                sample.finish_reason = FinishReason.ABORT.value
                ids.append(sample.core_request_id)
        self._drop(state, time.time())
        return ids

    def _drop(self, state: RequestState, now: float) -> None:
        state.finished_time = now
        self.requests.pop(state.request_id, None)
        for sample in state.samples:
            self._by_core_id.pop(sample.core_request_id, None)
