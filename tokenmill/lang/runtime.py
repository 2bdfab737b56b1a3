"""``Runtime``: the engine in this process as a ``Backend``.

One driver thread owns the engine (``tokenmill.LLM``'s engine core, input and output processors):
callers on any thread hand it a batch of requests and wait on a future; the driver admits each
batch all or none, steps the engine while anything runs (so every program's calls share its
batches and its prefix cache) and resolves each request's future when it finishes.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tokenmill.core.client import complete_now
from tokenmill.frontend.output_processor import RequestState
from tokenmill.frontend.tool_parsers import detect_tool_parser
from tokenmill.lang.backend import (
    Backend,
    CallResult,
    ChatTurns,
    ChoiceScores,
    TextCallback,
    check_choices,
    choice_span,
    encode_text,
    normalized_logprob,
)
from tokenmill.lang.chat_roles import ChatRoles
from tokenmill.lang.expr import Gen
from tokenmill.llm import LLM
from tokenmill.loader import resolve_model
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams


@dataclass
class _Job:
    """Requests admitted together; one future per request, an optional text callback per request."""

    requests: list[tuple[list[int], SamplingParams]]
    futures: list[Future[RequestOutput]]
    on_text: Callable[[str], None] | None = None


def sampling_params_of(gen: Gen) -> SamplingParams:
    """``gen``'s settings as engine ``SamplingParams`` (its constraint as structured outputs)."""
    constraint = None
    if gen.regex is not None:
        constraint = StructuredOutputsParams(regex=gen.regex)
    elif gen.json_schema is not None:
        constraint = StructuredOutputsParams(json=gen.json_schema)
    return SamplingParams(
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k,
        max_tokens=gen.max_tokens,
        stop=list(gen.stop),
        ignore_eos=gen.ignore_eos,
        seed=gen.seed,
        structured_outputs=constraint,
    )


class Runtime(Backend):
    """The engine in-process: ``Runtime("smollm2-135m", dtype="float32")`` takes ``LLM``'s keywords.

    Contract: thread-safe; a refused request raises ValueError in the calling thread and nothing of
    its batch stays in the engine; ``shutdown()`` stops the driver once running requests are done.
    """

    def __init__(self, model: str = "smollm2-135m", **engine_kwargs: Any) -> None:
        self.llm = LLM(model, **engine_kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self._architectures = list(getattr(resolve_model(model).hf_config, "architectures", None) or [])
        self._ids = itertools.count()
        self._inbox: queue.Queue[_Job | None] = queue.Queue()
        self._waiting: dict[str, tuple[Future[RequestOutput], Callable[[str], None] | None]] = {}
        self._roles = ChatRoles(lambda messages: self.llm.input_processor.render_chat(messages, False))
        self._failed: Exception | None = None
        self._driver = threading.Thread(target=self._drive, name="lang-runtime", daemon=True)
        self._driver.start()

    # ------------------------------------------------------------------ Backend

    def generate(self, prompt: str, gen: Gen, on_text: TextCallback | None = None) -> CallResult:
        [output] = self._run([(self.encode(prompt), sampling_params_of(gen))], on_text)
        completion = output.outputs[0]
        return CallResult(
            text=completion.text,
            prompt_tokens=len(output.prompt_token_ids),
            completion_tokens=len(completion.token_ids),
            cached_tokens=output.num_cached_tokens,
            finish_reason=completion.finish_reason,
        )

    def score_choices(self, prompt: str, choices: Sequence[str]) -> ChoiceScores:
        """Prime the prompt (for two or more choices), then score every choice in one batch of
        prompt-only requests whose logprobs start at the choice, so the prompt comes from the cache."""
        options = check_choices(choices)
        prompt_ids = self.encode(prompt)
        fulls = [self.encode(prompt + choice) for choice in options]
        starts = [choice_span(prompt_ids, full) for full in fulls]
        primed = self._run([(prompt_ids, SamplingParams(max_tokens=0))]) if len(options) > 1 else []
        outputs = self._run(
            [
                (full, SamplingParams(max_tokens=0, prompt_logprobs=0, prompt_logprobs_start=start))
                for full, start in zip(fulls, starts)
            ]
        )
        token_logprobs = []
        for output, full, start in zip(outputs, fulls, starts):
            assert output.prompt_logprobs is not None
            values = []
            for position in range(start, len(full)):
                entry = output.prompt_logprobs[position]
                assert entry is not None
                values.append(entry[full[position]].logprob)
            token_logprobs.append(values)
        everything = primed + outputs
        call = CallResult(
            text="",
            prompt_tokens=sum(len(o.prompt_token_ids) for o in everything),
            completion_tokens=0,
            cached_tokens=sum(o.num_cached_tokens for o in everything),
        )
        return ChoiceScores([normalized_logprob(v) for v in token_logprobs], token_logprobs, call)

    def prime(self, prompt: str) -> CallResult:
        [output] = self._run([(self.encode(prompt), SamplingParams(max_tokens=0))])
        return CallResult("", len(output.prompt_token_ids), 0, output.num_cached_tokens, "length")

    def chat_roles(self) -> ChatRoles:
        return self._roles

    def render_chat(self, turns: ChatTurns) -> str:
        return self.llm.input_processor.render_chat(turns.messages, tools=turns.tools or None)

    def chat_template_source(self) -> str | None:
        source = getattr(self.tokenizer, "chat_template", None)
        return source if isinstance(source, str) else None

    def tool_parser_name(self) -> str | None:
        return detect_tool_parser(getattr(self.tokenizer, "chat_template", None), self._architectures)

    def close(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the driver thread (after the requests it runs); the engine stays usable through ``llm``."""
        if self._driver.is_alive():
            self._inbox.put(None)
            self._driver.join()

    def encode(self, text: str) -> list[int]:
        """Token ids of a state's text (``backend.encode_text``)."""
        return encode_text(self.tokenizer, text)

    # ------------------------------------------------------------------ the driver

    def _run(
        self, requests: list[tuple[list[int], SamplingParams]], on_text: TextCallback | None = None
    ) -> list[RequestOutput]:
        if not self._driver.is_alive():
            raise RuntimeError(f"this Runtime is stopped ({self._failed or 'shut down'})")
        futures: list[Future[RequestOutput]] = [Future() for _ in requests]
        self._inbox.put(_Job(requests, futures, on_text))
        return [future.result() for future in futures]

    def _drive(self) -> None:
        client = self.llm.client
        while True:
            try:
                job = self._inbox.get(block=not client.has_unfinished_requests())
            except queue.Empty:
                pass
            else:
                if job is None:
                    return
                self._admit(job)
                continue  # take every waiting job before the next step
            try:
                step = complete_now(client.get_outputs())
                changed, to_abort = self.llm.output_processor.process(step.outputs)
                if to_abort:
                    client.abort_requests(to_abort)
                for state in changed:
                    self._deliver(state)
            except Exception as exc:  # an engine fault: every waiting caller gets it, none hangs
                for future, _ in self._waiting.values():
                    if not future.done():
                        future.set_exception(RuntimeError(f"the engine failed: {exc}"))
                self._waiting.clear()
                self._failed = exc
                return

    def _admit(self, job: _Job) -> None:
        processor, outputs = self.llm.input_processor, self.llm.output_processor
        admitted: list[str] = []
        try:
            for token_ids, params in job.requests:
                processor.check_prompt(token_ids, params)
            for (token_ids, params), future in zip(job.requests, job.futures):
                request_id = f"lang-{next(self._ids)}"
                core_requests = processor.make_requests(request_id, token_ids, params)
                outputs.add_request(request_id, None, token_ids, params)
                self._waiting[request_id] = (future, job.on_text)
                admitted.append(request_id)
                added = complete_now(self.llm.client.add_request_group(core_requests))
                if added.error is not None:
                    raise ValueError(added.error)
        except Exception as exc:  # refused: take back the batch, fail every future of it
            for request_id in admitted:
                self.llm.client.abort_requests(outputs.abort(request_id))
                self._waiting.pop(request_id, None)
            for future in job.futures:
                if not future.done():
                    future.set_exception(exc)

    def _deliver(self, state: RequestState) -> None:
        entry = self._waiting.get(state.request_id)
        if entry is None:
            return
        future, on_text = entry
        sample = state.samples[0]
        if on_text is not None and len(sample.text) > sample.sent_text:
            on_text(sample.text[sample.sent_text :])
            sample.sent_text = len(sample.text)
        if state.finished:
            del self._waiting[state.request_id]
            if sample.finish_reason == "error":
                future.set_exception(ValueError(f"the engine failed the request: {sample.stop_reason}"))
            else:
                future.set_result(state.to_output())
