"""Running a step in two passes: the prompts it finishes first, then everything else.

A step that finishes some prompts also advances the running requests (decodes, later chunks). Run
as one forward pass, the new requests' first tokens wait for all of it: on a CPU a step of 16
decodes over 1,100-token contexts takes ~45 ms, as long as a 66-token prefill over a cached
prefix. With ``SchedulerConfig.first_token_pass`` the engine core runs the prefills that finish
their prompts as a pass of their own and sends their first tokens at once, then runs the rest of
the planned step as a second pass before planning the next one. The scheduler's rule is unchanged
(one plan, the running requests served in it); only the order of the work within the step is. The
price is a second forward over the weights for the step's decodes, which is why offline batches
(``LLM``) keep one pass. SGLang runs prefill batches apart from decode batches by default for the
same reason.

A plan is not split when a request of the second pass computes blocks that a request of the first
pass attends to in the same step (``SchedulerOutput.shared_sources``): they must be written first.
Nor while more than ``MAX_WAITING_TO_SPLIT`` requests wait behind the step: a second pass costs a
pass's fixed part again (on a 2-core CPU ~12 ms of a 16-sequence decode pass's ~33), and every
waiting request's first token waits for it too, so once two wait that outweighs the ~20 ms the
split saves the step's own first tokens. In a burst of arrivals the steps then run whole: the
shared-prefix run's first 16 requests 1,196 ms on average against 1,257 split (4 runs each).
Pure bookkeeping on the plan; no torch.
"""

from __future__ import annotations

from dataclasses import replace

from tokenmill.core.step_io import ScheduledRequest, SchedulerOutput

# Most requests that may wait behind a step that runs in two passes (see the module docstring).
MAX_WAITING_TO_SPLIT = 1


def finishes_prompt(entry: ScheduledRequest) -> bool:
    """Whether ``entry`` computes the last prompt tokens of a request that has no output yet, so
    that this step samples its first token."""
    return entry.sample and not entry.output_token_ids


def split_first_tokens(
    plan: SchedulerOutput, num_waiting: int = 0
) -> tuple[SchedulerOutput, SchedulerOutput] | None:
    """``(first, rest)``: the entries of ``plan`` that produce a first token, then the others; None
    when the plan is better run as one pass (one of the two would be empty, the step already serves
    only first tokens of a TTFT tier, a second-pass request computes blocks the first pass reads, or
    more than ``MAX_WAITING_TO_SPLIT`` of ``num_waiting`` requests wait behind the step).

    ``first`` carries the plan's finished ids and preemption count; ``rest`` carries neither and is
    never interruptible (the plan that made it planned first tokens, so it was not either).
    """
    if plan.first_token_exclusive or plan.interruptible or num_waiting > MAX_WAITING_TO_SPLIT:
        return None
    first = [entry for entry in plan.scheduled if finishes_prompt(entry)]
    if not first or len(first) == len(plan.scheduled):
        return None
    first_ids = {entry.request_id for entry in first}
    if any(source not in first_ids for source in plan.shared_sources):
        return None
    rest = [entry for entry in plan.scheduled if entry.request_id not in first_ids]
    first_plan = replace(
        plan, scheduled=first, grammar_bitmask=None, shared_sources=list(plan.shared_sources)
    )
    rest_plan = SchedulerOutput(scheduled=rest, propose_drafts=plan.propose_drafts)
    return first_plan, rest_plan
