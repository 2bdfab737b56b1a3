"""The engine core's view of one sequence: token ids and progress, no text, no tensors."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from tokenmill.protocol import EngineCoreRequest, FinishReason, PositionLogprobs
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.structured.manager import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """One sequence being generated.

    The single scheduling rule (DESIGN.md section 2) works on two numbers: ``num_tokens`` (prompt +
    output so far) and ``num_computed_tokens`` (how many of those have KV in the cache). Each step
    the scheduler lets ``num_computed_tokens`` catch up; when it reaches ``num_tokens`` the step's
    logits for the last token are sampled and one token is appended.
    """

    def __init__(self, core_request: EngineCoreRequest, max_model_len: int) -> None:
        self.request_id = core_request.request_id
        self.prompt_token_ids = list(core_request.prompt_token_ids)
        self.sampling_params: SamplingParams = core_request.sampling_params
        self.eos_token_ids = set(core_request.eos_token_ids)
        self.arrival_time = core_request.arrival_time
        self.priority = core_request.priority
        self.group_id = core_request.group_id
        self.sibling_index = core_request.sibling_index
        self.cache_salt = core_request.cache_salt
        # The engine's id of this request's LoRA adapter load (None: the base model), set by the
        # engine core from ``core_request.lora_name``; part of the prefix cache's namespace.
        self.lora_id: int | None = None
        # Scheduling class and fairness: ``auto`` is resolved to ``default`` by the scheduler.
        self.tier = core_request.service_tier
        self.user = core_request.user or ""
        self.deadline = core_request.deadline
        # Prompt positions already charged to the user's virtual token counter (not again on recompute).
        self.num_prompt_charged = 0
        # Scheduler-clock times of the first and latest sampled token, and the latest gap between two.
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.last_token_interval: float | None = None
        # Set once a gap came close to the tier's TPOT target: worse tiers stay held back from then on.
        self.tpot_guarded = False
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # Put back to wait once by the ``lpm`` policy just after its first step began
        # (``Scheduler.replan_paused``); never again.
        self.replanned = False
        # Prompt positions whose logprobs were already computed and sent (survives preemption).
        self.num_prompt_logprobs_done = 0
        # The first prompt token has no context, so its entry is None (also for a one-token prompt).
        self.pending_prompt_logprobs: list[PositionLogprobs | None] = (
            [None] if self.wants_prompt_logprobs else []
        )
        # Structured outputs: the request's grammar (set by the engine core), the tokens jump-forward
        # appended since the last sampled one (their draws are skipped in the seeded generator), and why
        # the request failed, if it did.
        self.grammar: GrammarState | None = None
        self.num_forced_since_sample = 0
        self.error: str | None = None
        # Speculative decoding (core/spec_decode.py): the proposer's drafts for the next step (never
        # part of ``all_token_ids``), and the running estimate of how often this request's drafts
        # are accepted (None until one was verified).
        self.draft_token_ids: list[int] = []
        self.draft_acceptance: float | None = None
        params = self.sampling_params
        limit = max_model_len - len(self.prompt_token_ids)
        self.max_tokens = limit if params.max_tokens is None else min(params.max_tokens, limit)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """Decide whether the last appended token ends the sequence; records why.

        EOS and stop token ids end it once ``min_tokens`` have been produced (the sampler forbids
        them before that); ``max_tokens`` (already capped by the context window) ends it with
        ``length``. Stop strings are checked by the detokenizer, which aborts the request.
        """
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.finish_reason = FinishReason.STOP
                return True
            if last in params.stop_token_ids:  # type: ignore[operator]
                self.finish_reason = FinishReason.STOP
                self.stop_reason = last
                return True
        if self.num_output_tokens >= self.max_tokens:
            self.finish_reason = FinishReason.LENGTH
            return True
        return False

    def tokens_forbidden_now(self) -> list[int]:
        """Token ids the sampler must not pick this step (EOS and stop ids before min_tokens)."""
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens:
            return []
        forbidden = list(params.stop_token_ids or [])
        if not params.ignore_eos:
            forbidden.extend(self.eos_token_ids)
        return forbidden
