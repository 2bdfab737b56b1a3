"""Speculative decoding's bookkeeping in the scheduler: how many drafts a step verifies, and what
a verification leaves behind.

Drafts are plan entries under the one rule: a decoding request with drafts catches up towards
``num_tokens + num_drafts``, so its entry computes its last real token and the drafts, within the
step's token budget (``Scheduler._schedule_running``). The drafts themselves come from the worker's
proposer (``spec/``) in the previous step's ``ModelRunnerOutput.draft_token_ids`` and live in
``Request.draft_token_ids``, never in ``all_token_ids``.

After the step, ``apply_verified`` appends the tokens the rejection sampler kept (accepted drafts,
then one sampled token) through the stop checks, so a stop token or ``max_tokens`` cuts a draft run
where plain decoding would have stopped; ``num_computed_tokens`` advances over the accepted drafts
only (their keys and values were computed with the right tokens), and the blocks reserved for the
rejected ones are given back. The prefix cache only ever sees computed, verified tokens.

Adaptive draft length: drafting pays while the expected accepted share of an extra token is worth
its cost. With the step-time model's ``seconds ≈ a + b·tokens + c·seqs`` and ``S`` decoding
sequences, a plain decode step yields ``S`` tokens in ``T = a + (b + c)·S`` seconds; a draft at depth
``j``, accepted with probability ``α^j`` (``α``: the request's running acceptance rate), adds ``b``
seconds for ``α^j`` expected tokens, so it is planned only while ``α^j > b·S / T``. On an idle CPU
the fixed and per-sequence costs dominate and every draft pays; on a large, compute-bound batch the
bound nears 1 and drafting stops. The model can only price a draft token once it has seen steps with
drafts, so the first ``EXPLORE_STEPS`` steps that can draft, and one in every ``EXPLORE_EVERY`` after a
run without drafts, plan drafts without the bound. The linear model cannot see everything a
verifying step costs on a CPU (kernels whose cost grows per row, the drafter), so under adaptive
drafting a measured gate (``core/spec_payoff.py``) also stops drafting for a batch-size class whose
drafted decode steps yield fewer tokens per second than its plain ones. Ints and floats only, no
torch.
"""

from __future__ import annotations

from tokenmill.config import SpeculativeConfig
from tokenmill.core.kv.manager import KVCacheManager
from tokenmill.core.output_tokens import append_one
from tokenmill.core.request import Request
from tokenmill.core.spec_payoff import DraftPayoff
from tokenmill.core.step_io import ScheduledRequest, SchedulerOutput
from tokenmill.core.step_time import StepTimeModel

# The acceptance rate assumed for a request before any of its drafts was verified (and before any
# request's was), and how fast a request's running rate follows its verifications.
PRIOR_ACCEPTANCE = 0.6
ACCEPTANCE_SMOOTHING = 0.3
# Steps with drafts planned freely before the bound applies, and how often (in steps without drafts)
# a step drafts freely again: the step-time model can only price a draft token after seeing steps
# that hold more tokens than sequences (decode-only steps cannot tell the two costs apart).
EXPLORE_STEPS = 8
EXPLORE_EVERY = 64


class SpecDecodeState:
    """The scheduler's speculative side (see the module docstring). With ``config`` None every
    method is a no-op and no drafts are planned.

    Contract: ``begin_step`` once per ``schedule``; ``num_drafts_to_plan`` for each running request
    planned; ``apply_verified`` once per verified entry, before the request may finish;
    ``observe_step`` with each executed step's measured time, after its ``apply_verified`` calls.
    """

    def __init__(self, config: SpeculativeConfig | None, step_time: StepTimeModel) -> None:
        self.config = config
        self.step_time = step_time
        self.draft_cost_bound = 0.0  # of the step being planned: b·S / T (see the module docstring)
        self.num_drafted_steps = 0  # steps that planned drafts
        self.steps_since_drafted = 0
        self._step_drafted = False  # whether the step being planned has drafts
        self.num_drafts = 0  # entries verified with at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        k = 0 if config is None else config.num_speculative_tokens
        self.proposed_at = [0] * k  # per draft position: drafts verified there
        self.accepted_at = [0] * k  # per draft position: drafts accepted there
        # Whether proposing that finds nothing costs nothing (a lookup, no model pass): see observe_step.
        self.free_misses = config is not None and config.method == "ngram"
        # A drafter that runs a model catches up over the positions it skipped when drafting resumes:
        # re-measuring it costs more the larger the batch (core/spec_payoff.py).
        self.payoff = DraftPayoff(batch_scaled_exploring=not self.free_misses)
        self._paused = False  # the gate stopped drafting for the step being planned
        # The gate's decision for the next step, made a step ahead so that the runner drafts (after
        # sampling this step) only for a step that will verify drafts: the plan's ``propose_drafts``.
        self.propose_next = True
        self._step_accepted = 0  # drafts accepted since the last observed step

    def check_request(self, request: Request) -> None:
        """Refuse (ValueError) a request whose features do not compose with speculative decoding yet."""
        if self.config is None:
            return

    def begin_step(self, num_running: int) -> None:
        """Fix the step's bound on a draft's acceptance probability (0 when the step-time model cannot
        predict yet, or adaptive drafting is off: then every draft is planned)."""
        if self._step_drafted:
            self.num_drafted_steps += 1
            self.steps_since_drafted = 0
        else:
            self.steps_since_drafted += 1
        self._step_drafted = False
        self.draft_cost_bound = 0.0
        self._paused = False
        self._step_accepted = 0  # a paused pass's step is updated but never observed: start afresh
        if self.config is None or not self.config.adaptive or num_running == 0:
            self.propose_next = True
            return
        self._paused = not self.propose_next
        self.propose_next = self.payoff.should_draft(num_running)
        if self.num_drafted_steps < EXPLORE_STEPS or self.steps_since_drafted >= EXPLORE_EVERY:
            return
        fit = self.step_time.coefficients
        if fit is None:
            return
        a, b, c = fit
        plain_step = a + (b + c) * num_running
        if plain_step > 0.0:
            self.draft_cost_bound = b * num_running / plain_step

    def num_drafts_to_plan(self, request: Request) -> int:
        """How many of ``request``'s drafts the step may verify: none unless it is decoding (one token
        left to compute), none past ``max_tokens`` (the verification always adds one token of its own),
        and under adaptive drafting only those whose expected acceptance pays for them."""
        drafts = request.draft_token_ids
        if self.config is None or not drafts or request.num_tokens - request.num_computed_tokens != 1:
            return 0
        if self._paused:
            return 0
        limit = min(len(drafts), request.max_tokens - request.num_output_tokens - 1)
        if limit > 0 and request.grammar is not None:
            # Only drafts the grammar allows are worth verifying (each is masked at its position).
            limit = request.grammar.valid_draft_prefix(drafts[:limit])
        if self.draft_cost_bound <= 0.0:
            self._step_drafted = self._step_drafted or limit > 0
            return max(0, limit)
        rate = request.draft_acceptance
        if rate is None:
            rate = self.acceptance_rate() or PRIOR_ACCEPTANCE
        count, reach = 0, 1.0
        while count < limit:
            reach *= rate
            if reach <= self.draft_cost_bound:
                break
            count += 1
        if count == 0 and request.draft_acceptance is not None:
            # Withheld: its estimate drifts back towards the prior, so a request whose drafts failed
            # once tries again later (copying often starts after a stretch of new text).
            request.draft_acceptance += ACCEPTANCE_SMOOTHING * (PRIOR_ACCEPTANCE - request.draft_acceptance)
        self._step_drafted = self._step_drafted or count > 0
        return count

    def apply_verified(
        self, request: Request, entry: ScheduledRequest, tokens: list[int], kv: KVCacheManager
    ) -> tuple[list[int], bool]:
        """Append the verification's ``tokens`` (accepted drafts, then one more) through the stop
        checks; advance ``num_computed_tokens`` over the accepted drafts, give back the blocks of the
        rejected ones and publish the newly completed blocks. Returns the appended tokens and whether
        the request finished (then the caller finishes it)."""
        num_drafts = len(entry.draft_token_ids)
        num_accepted = len(tokens) - 1
        if num_accepted > num_drafts or tokens[:num_accepted] != entry.draft_token_ids[:num_accepted]:
            raise RuntimeError(f"request {request.request_id!r}: verified tokens do not extend its drafts")
        appended: list[int] = []
        stopped = False
        for token in tokens:
            appended.append(token)
            stopped = append_one(request, token)
            if stopped:
                break
        num_verified = len(appended)
        grammar = request.grammar
        while not stopped and grammar is not None and (forced := grammar.forced_token()) is not None:
            appended.append(forced)  # jump-forward, as after a plain sample (core/output_tokens.py)
            stopped = append_one(request, forced)
        request.num_forced_since_sample = len(appended) - num_verified
        request.num_computed_tokens += min(num_accepted, num_verified)
        kv.trim_slots(request, request.num_tokens)
        kv.cache_computed_blocks(request)
        kv.release_out_of_window_blocks(request)
        self._count(request, num_drafts, num_accepted)
        return appended, stopped

    def observe_step(self, plan: SchedulerOutput, seconds: float) -> None:
        """Feed a decode-only step's tokens per second to the drafting gate (``core/spec_payoff.py``):
        one token per entry plus the drafts accepted since the last observed step, on the side of the
        step's mode (verifying the previous step's proposals or not; the gate drops a step whose
        mode differs from whether it proposed). Steps with prompt tokens, and verifying steps that
        verify no draft, are not observed."""
        accepted, self._step_accepted = self._step_accepted, 0
        if self.config is None or not self.config.adaptive or not plan.scheduled:
            return
        if any(e.start_position < len(e.prompt_token_ids) or not e.sample for e in plan.scheduled):
            return
        # The side is the step's mode. A verifying step whose n-gram proposer found nothing at all is
        # measured on neither side: a lookup costs next to nothing, so the step is a plain one, and on
        # the drafted side runs of misses (text that is not copied, before a copy starts) would stop
        # drafting for the stretch where drafts pay. A model's pass is not free: a step whose drafter
        # ran and cut every draft (an EAGLE head below draft_confidence, three steps in four on chat)
        # paid for it, and counts on the drafted side.
        verifying = not self._paused
        if verifying and self.free_misses and not any(e.draft_token_ids for e in plan.scheduled):
            return
        self.payoff.observe(
            len(plan.scheduled),
            len(plan.scheduled) + accepted,
            verifying,
            seconds,
            proposed=plan.propose_drafts,
        )

    def _count(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        self._step_accepted += num_accepted
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for j in range(num_drafts):
            self.proposed_at[j] += 1
            self.accepted_at[j] += j < num_accepted
        # Per-draft acceptance: the accepted ones out of those tried (a run ends at its first rejection).
        trials = num_accepted + (num_accepted < num_drafts)
        rate = num_accepted / trials
        old = request.draft_acceptance
        request.draft_acceptance = rate if old is None else old + ACCEPTANCE_SMOOTHING * (rate - old)

    def acceptance_rate(self) -> float | None:
        """Accepted drafts over drafts verified so far, or None before any."""
        if not self.num_draft_tokens:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    def stats(self) -> dict[str, int | float]:
        """Counters for ``kv_stats`` / ``/v1/admin/kv``: draft and accepted token totals, the mean
        accepted length (tokens a verified entry yields: accepted drafts plus the sampled one) and
        the acceptance rate at each draft position (``spec_acceptance_at_<j>``, from 1)."""
        if self.config is None:
            return {}
        stats: dict[str, int | float] = {
            "spec_num_drafts": self.num_drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_mean_accepted_length": (
                1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
            ),
        }
        for j, (proposed, accepted) in enumerate(zip(self.proposed_at, self.accepted_at, strict=True)):
            stats[f"spec_acceptance_at_{j + 1}"] = accepted / proposed if proposed else 0.0
        return stats
