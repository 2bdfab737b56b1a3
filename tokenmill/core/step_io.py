"""The plan and result types that cross the executor boundary: a leaf module of the core.

The scheduler produces a ``SchedulerOutput`` per step; an executor runs it and hands back a
``ModelRunnerOutput``. Workers, layers, models and samplers import these types and nothing else of
``tokenmill.core``: this module imports nothing of the core (or of any other tokenmill package but
``sampling_params`` and ``protocol``, which are leaves too).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from tokenmill.protocol import PositionLogprobs
from tokenmill.sampling_params import SamplingParams

# The table entry of a block released because it fell out of every layer's window (the KV manager
# writes it; the plan's wire form and the model runner read it): the runner reads such entries as
# block 0, and the attention mask never lets a query see them.
RELEASED_BLOCK = -1


@dataclass
class GrammarBitmask:
    """One step's allowed-token bitmasks for the constrained sampling rows.

    ``rows[request_id]`` is the row of ``bitmask`` (``[num_rows, ceil(vocab / 32)]`` int32) for that
    request (its first of ``1 + len(draft_token_ids)`` consecutive rows when its entry verifies
    speculative drafts); requests without a grammar are absent and their logits are left alone.
    """

    rows: dict[str, int]
    bitmask: torch.Tensor


@dataclass
class ScheduledRequest:
    """One request's share of a step: which tokens to compute and whether to sample after them.

    ``token_ids`` are the tokens at positions ``start_position .. start_position + len - 1``;
    ``block_table`` covers all of them. ``sample`` is set when this step reaches the end of the
    sequence, so the last position's logits pick the next token. ``prompt_logprobs_range`` is the
    half-open range of prompt positions whose next-token logprobs to compute this step.
    ``skipped_draws`` counts tokens jump-forward appended since the last sample: a seeded row skips
    that many draws, so its random stream is the one it would have had sampling them.
    ``lora_slot`` is the device slot of the request's LoRA adapter (-1: the base model).
    ``draft_token_ids`` are speculative drafts to verify: the last ``len(draft_token_ids)`` entries of
    ``token_ids`` (a sampling step's last real token comes just before them). The step computes logits
    at that token and at every draft, and the rejection sampler keeps the drafts the target agrees with.
    Models with a recurrent state (linear attention) read ``state_slot``, the request's slot of the
    state pool (-1: the model keeps none); before the step the runner copies snapshot slot
    ``state_source`` into it (-1: none; the slot is zeroed instead when the step starts at position
    0), and ``state_checkpoints`` lists ``(position, snapshot slot)`` pairs: the state after the
    tokens before ``position`` is to be copied into that slot (positions inside this step's range).
    ``window_block_table`` is the sliding-window layers' own table when the model keeps them in a
    second KV group (``core/kv/window_group.py``; entries -1 were released), else None.
    """

    request_id: str
    token_ids: list[int]
    start_position: int
    block_table: list[int]
    sample: bool
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    forbidden_token_ids: list[int]
    prompt_logprobs_range: tuple[int, int] | None
    seed: int | None
    skipped_draws: int = 0
    lora_slot: int = -1
    draft_token_ids: list[int] = field(default_factory=list)
    state_slot: int = -1
    state_source: int = -1
    state_checkpoints: list[tuple[int, int]] = field(default_factory=list)
    window_block_table: list[int] | None = None

    @property
    def end_position(self) -> int:
        """The request's computed tokens once this step has run."""
        return self.start_position + len(self.token_ids)


@dataclass
class SchedulerOutput:
    """A step's plan. ``finished_request_ids`` lists requests that ended since the last plan, so
    executors can drop per-request state (seeded generators). ``grammar_bitmask`` holds the allowed
    tokens of the constrained sampling rows (filled in by the engine core), or None."""

    scheduled: list[ScheduledRequest]
    finished_request_ids: list[str] = field(default_factory=list)
    num_preempted: int = 0
    grammar_bitmask: GrammarBitmask | None = None
    # The step serves only a tier awaiting a first token within its TTFT target (and better ones).
    first_token_exclusive: bool = False
    # The model may abandon this step between layers for a latency-critical arrival (step_control.py).
    interruptible: bool = False
    # The model may pause this step between layers for an arrival's short prefill, and go on after it.
    pausable: bool = False
    # Requests whose blocks computed in this step other requests of it attend to (same-step prefix
    # sharing): the step's keys and values must be written before those requests attend.
    shared_sources: list[str] = field(default_factory=list)
    # Whether the runner drafts for the next step after sampling this one: speculative decoding's
    # measured gate pauses drafting where it does not pay, drafter included (core/spec_payoff.py).
    propose_drafts: bool = True

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class StepStatus(str, enum.Enum):
    """How a step's forward ended (``step_control.py``): the executor turns a stop between layers
    into one of these, so no exception crosses the executor boundary.

    ``DONE``: it ran to the end; the output holds its tokens. ``PAUSED``: a ``pausable`` plan stopped
    before a layer; the executor keeps it (batch, hidden states) until ``resume`` or
    ``discard_paused``, and the output holds nothing but how far it got. ``ABANDONED``: an
    ``interruptible`` plan stopped and was dropped; nothing of it counts.
    """

    DONE = "done"
    PAUSED = "paused"
    ABANDONED = "abandoned"


@dataclass
class ModelRunnerOutput:
    """What the executor computed: a token per sampling request, and the logprobs asked for.

    ``status`` says whether the step ran to the end (only then do the other fields hold anything);
    ``layers_done`` is the share of the model's layers a ``PAUSED`` step has run (0.0 to 1.0).
    ``draft_token_ids`` holds a speculative proposer's drafts per request, for the next step.
    ``verified_token_ids`` holds, for a request whose plan entry carried drafts, every token its
    verification produced (the accepted drafts, then one token the target sampled); its first token is
    also in ``sampled_token_ids``. ``verified_logprobs`` holds one entry per such token when asked.
    """

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    verified_token_ids: dict[str, list[int]] = field(default_factory=dict)
    verified_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    status: StepStatus = StepStatus.DONE
    layers_done: float = 1.0
