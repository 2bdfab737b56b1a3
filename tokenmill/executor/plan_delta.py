"""Plans as deltas: the engine side remembers what each worker was sent, the worker side keeps
per-request state and rebuilds the plan.

``PlanEncoder.encode`` turns a ``SchedulerOutput`` into a ``StepPlanData`` that carries a request's
prompt, parameters and block table once (``NewRequestData``) and then only what changed
(``CachedRequestData``: output tokens appended, table entries changed, blocks appended).
``PlanDecoder.decode`` applies it and returns a ``SchedulerOutput`` whose ``ScheduledRequest``s equal
the originals field for field. Contract: every plan the encoder encodes is decoded, in the same
order, by one decoder (a worker's); both drop a request's state when its id is in a plan's
``finished_request_ids``.

The delta is computed from the request's lists as they are, never from assumptions about what the
scheduler did: block tables lose a prefix to sliding-window releases (entries become -1) and
siblings' copies of a block are swapped for the shared one (each a change of table entries). A
request whose table got shorter (preemption restarts it), whose prompt or parameters are other
objects (a new request reusing an id) or whose outputs are not what was sent plus more is sent in
full again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.core.step_io import (
    RELEASED_BLOCK,
    GrammarBitmask,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    StepStatus,
)
from tokenmill.protocol import (
    CachedRequestData,
    GrammarBitmaskData,
    NewRequestData,
    StepDone,
    StepPlanData,
)
from tokenmill.sampling_params import SamplingParams


@dataclass
class _SentRequest:
    """What a worker holds for one request, as the encoder last sent it. ``prompt`` and ``params``
    are the scheduler's own objects, compared by identity."""

    prompt: list[int]
    params: SamplingParams
    num_outputs: int
    last_output: int | None
    block_ids: list[int]
    lora_slot: int = -1


class PlanEncoder:
    """The engine side: one per worker (group of workers that get the same plans)."""

    def __init__(self) -> None:
        self._sent: dict[str, _SentRequest] = {}

    def encode(self, plan: SchedulerOutput) -> StepPlanData:
        """The delta from what was sent so far to ``plan``; remembers ``plan`` as sent. Call it when
        the plan runs: ``ScheduledRequest`` lists are the scheduler's live ones."""
        for request_id in plan.finished_request_ids:
            self._sent.pop(request_id, None)
        new_requests: list[NewRequestData] = []
        scheduled: list[CachedRequestData] = []
        for entry in plan.scheduled:
            sent = self._sent.get(entry.request_id)
            delta = None if sent is None else self._delta(entry, sent)
            if delta is None:
                new_requests.append(self._send_in_full(entry))
                delta = _cached(entry.request_id, [], [], [])
            delta.start_position = entry.start_position
            delta.num_tokens = len(entry.token_ids)
            delta.sample = entry.sample
            delta.forbidden_token_ids = list(entry.forbidden_token_ids)
            delta.prompt_logprobs_range = entry.prompt_logprobs_range
            delta.skipped_draws = entry.skipped_draws
            delta.draft_token_ids = list(entry.draft_token_ids)
            delta.state_slot, delta.state_source = entry.state_slot, entry.state_source
            delta.state_checkpoints = list(entry.state_checkpoints)
            if entry.window_block_table is not None:
                delta.window_released, delta.window_blocks = _split_released(entry.window_block_table)
            scheduled.append(delta)
        return StepPlanData(
            new_requests=new_requests,
            scheduled=scheduled,
            finished_request_ids=list(plan.finished_request_ids),
            num_preempted=plan.num_preempted,
            grammar_bitmask=None if plan.grammar_bitmask is None else encode_bitmask(plan.grammar_bitmask),
            first_token_exclusive=plan.first_token_exclusive,
            interruptible=plan.interruptible,
            pausable=plan.pausable,
            shared_sources=list(plan.shared_sources),
            propose_drafts=plan.propose_drafts,
        )

    def _send_in_full(self, entry: ScheduledRequest) -> NewRequestData:
        table = list(entry.block_table)
        outputs = entry.output_token_ids
        self._sent[entry.request_id] = _SentRequest(
            prompt=entry.prompt_token_ids,
            params=entry.sampling_params,
            num_outputs=len(outputs),
            last_output=outputs[-1] if outputs else None,
            block_ids=list(table),
            lora_slot=entry.lora_slot,
        )
        return NewRequestData(
            request_id=entry.request_id,
            prompt_token_ids=list(entry.prompt_token_ids),
            output_token_ids=list(outputs),
            sampling_params=entry.sampling_params,
            seed=entry.seed,
            block_ids=table,
            lora_slot=entry.lora_slot,
        )

    def _delta(self, entry: ScheduledRequest, sent: _SentRequest) -> CachedRequestData | None:
        """The change from ``sent`` to ``entry``'s request (updating ``sent``), or None when it is not
        one a delta can say. The per-step fields are filled in by the caller."""
        if entry.prompt_token_ids is not sent.prompt or entry.sampling_params is not sent.params:
            return None
        if entry.lora_slot != sent.lora_slot:  # put back to wait and readmitted with another slot
            return None
        outputs, table, sent_table = entry.output_token_ids, entry.block_table, sent.block_ids
        if len(outputs) < sent.num_outputs or (
            sent.num_outputs and outputs[sent.num_outputs - 1] != sent.last_output
        ):
            return None
        num_sent_blocks = len(sent_table)
        if len(table) < num_sent_blocks:
            return None
        changed: list[tuple[int, int]] = []
        if table[:num_sent_blocks] != sent_table:  # rare: compared at C speed first
            changed = [(i, b) for i, b in enumerate(table[:num_sent_blocks]) if b != sent_table[i]]
            for i, b in changed:
                sent_table[i] = b
        new_outputs = outputs[sent.num_outputs :]
        new_blocks = table[num_sent_blocks:]
        sent.num_outputs = len(outputs)
        sent.last_output = outputs[-1] if outputs else None
        sent_table.extend(new_blocks)
        return _cached(entry.request_id, list(new_outputs), changed, list(new_blocks))


@dataclass
class _WorkerRequest:
    """A worker's own state of one request."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int | None
    block_table: list[int]
    lora_slot: int = -1


class PlanDecoder:
    """The worker side: keeps each request's state across steps and rebuilds the plans."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self.requests: dict[str, _WorkerRequest] = {}

    def decode(self, data: StepPlanData) -> SchedulerOutput:
        """Apply ``data`` to the kept state and return the plan it stands for."""
        for request_id in data.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in data.new_requests:
            self.requests[new.request_id] = _WorkerRequest(
                prompt_token_ids=new.prompt_token_ids,
                output_token_ids=new.output_token_ids,
                sampling_params=new.sampling_params,
                seed=new.seed,
                block_table=new.block_ids,
                lora_slot=new.lora_slot,
            )
        scheduled = [self._apply(delta) for delta in data.scheduled]
        return SchedulerOutput(
            scheduled=scheduled,
            finished_request_ids=data.finished_request_ids,
            num_preempted=data.num_preempted,
            grammar_bitmask=None if data.grammar_bitmask is None else decode_bitmask(data.grammar_bitmask),
            first_token_exclusive=data.first_token_exclusive,
            interruptible=data.interruptible,
            pausable=data.pausable,
            shared_sources=data.shared_sources,
            propose_drafts=data.propose_drafts,
        )

    def _apply(self, delta: CachedRequestData) -> ScheduledRequest:
        state = self.requests.get(delta.request_id)
        if state is None:
            raise RuntimeError(f"worker got a step for request {delta.request_id!r} it was never sent")
        state.output_token_ids.extend(delta.new_output_token_ids)
        table = state.block_table
        for index, block_id in delta.changed_blocks:
            table[index] = block_id
        table.extend(delta.new_block_ids)
        drafts = delta.draft_token_ids
        start, end = delta.start_position, delta.start_position + delta.num_tokens - len(drafts)
        prompt, outputs = state.prompt_token_ids, state.output_token_ids
        num_prompt = len(prompt)
        if end > num_prompt + len(outputs):
            raise RuntimeError(f"request {delta.request_id!r}: tokens up to {end} planned, worker has fewer")
        # Slice prompt and outputs apart: joining them would copy the whole sequence every step.
        token_ids = (
            prompt[start:end]
            if end <= num_prompt
            else prompt[start:] + outputs[max(0, start - num_prompt) : end - num_prompt]
        )
        if drafts:
            token_ids = token_ids + drafts
        return ScheduledRequest(
            request_id=delta.request_id,
            token_ids=token_ids,
            start_position=start,
            block_table=table,
            sample=delta.sample,
            sampling_params=state.sampling_params,
            prompt_token_ids=prompt,
            output_token_ids=outputs,
            forbidden_token_ids=delta.forbidden_token_ids,
            prompt_logprobs_range=delta.prompt_logprobs_range,
            seed=state.seed,
            skipped_draws=delta.skipped_draws,
            lora_slot=state.lora_slot,
            draft_token_ids=drafts,
            state_slot=delta.state_slot,
            state_source=delta.state_source,
            state_checkpoints=[(position, slot) for position, slot in delta.state_checkpoints],
            window_block_table=(
                None
                if delta.window_released < 0
                else [RELEASED_BLOCK] * delta.window_released + list(delta.window_blocks)
            ),
        )


def _split_released(table: list[int]) -> tuple[int, list[int]]:
    """A window-group table as (its released leading entries, the blocks after them)."""
    released = 0
    while released < len(table) and table[released] == RELEASED_BLOCK:
        released += 1
    return released, table[released:]


def _cached(
    request_id: str, new_outputs: list[int], changed: list[tuple[int, int]], new_blocks: list[int]
) -> CachedRequestData:
    """A delta with its per-step fields still to fill in."""
    return CachedRequestData(
        request_id=request_id,
        new_output_token_ids=new_outputs,
        changed_blocks=changed,
        new_block_ids=new_blocks,
        start_position=0,
        num_tokens=0,
        sample=False,
        forbidden_token_ids=[],
        prompt_logprobs_range=None,
        skipped_draws=0,
    )


def encode_bitmask(bitmask: GrammarBitmask) -> GrammarBitmaskData:
    tensor = bitmask.bitmask.detach().to("cpu", torch.int32).contiguous()  # [num_constrained, words]
    return GrammarBitmaskData(rows=bitmask.rows, shape=list(tensor.shape), data=tensor.numpy().tobytes())


def decode_bitmask(data: GrammarBitmaskData) -> GrammarBitmask:
    flat = torch.frombuffer(bytearray(data.data), dtype=torch.int32)  # [num_constrained * words]
    return GrammarBitmask(rows=data.rows, bitmask=flat.reshape(data.shape))


def output_to_wire(output: ModelRunnerOutput) -> StepDone:
    return StepDone(
        status=output.status.value,
        layers_done=output.layers_done,
        sampled_token_ids=output.sampled_token_ids,
        logprobs=output.logprobs,
        prompt_logprobs=output.prompt_logprobs,
        draft_token_ids=output.draft_token_ids,
        verified_token_ids=output.verified_token_ids,
        verified_logprobs=output.verified_logprobs,
    )


def output_from_wire(done: StepDone) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        sampled_token_ids=done.sampled_token_ids,
        logprobs=done.logprobs,
        prompt_logprobs=done.prompt_logprobs,
        draft_token_ids=done.draft_token_ids,
        verified_token_ids=done.verified_token_ids,
        verified_logprobs=done.verified_logprobs,
        status=StepStatus(done.status),
        layers_done=done.layers_done,
    )
