"""The model runner's speculative side: verify a step's drafts, then draft for the next step.

``verify_entries`` expands each drafted request into one sampling row per verified position (row
``j`` sees the drafts before it as outputs, for penalties and the min-tokens block) and hands them to
the rejection sampler (``sample/rejection.py``). ``draft_contexts`` gives the proposer each sampled
request's sequence as it stands after this step's tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill.core.step_io import GrammarBitmask, ModelRunnerOutput, ScheduledRequest
from tokenmill.protocol import PositionLogprobs
from tokenmill.sample.build import RowSamplingInput, build_sampling_metadata
from tokenmill.sample.rejection import verify_drafts
from tokenmill.spec.proposer import DraftContext


def verify_entries(
    logits: torch.Tensor,
    entries: list[ScheduledRequest],
    generators_for: Callable[[ScheduledRequest], list[torch.Generator | None]],
    output: ModelRunnerOutput,
    device: torch.device,
    grammar: GrammarBitmask | None,
) -> None:
    """Verify ``entries``' drafts against ``logits`` (``1 + len(drafts)`` rows per entry, in order)
    and record the tokens each keeps (``output.verified_token_ids``, first one also in
    ``sampled_token_ids``) and their logprobs when asked. A constrained entry's rows are masked with
    its ``1 + len(drafts)`` consecutive rows of ``grammar``. ``generators_for(entry)`` gives each of
    its rows' generators: the request's one generator on every row, or in the deterministic mode one
    per row, seeded by the position the row samples."""
    rows: list[RowSamplingInput] = []
    for entry in entries:
        generators = generators_for(entry)
        params = entry.sampling_params
        uses_outputs = (
            params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
            or params.repetition_penalty != 1.0
        )
        num_outputs = len(entry.output_token_ids)
        first_mask = None if grammar is None else grammar.rows.get(entry.request_id)
        for j in range(len(entry.draft_token_ids) + 1):
            outputs = entry.output_token_ids
            if uses_outputs and j:
                outputs = outputs + entry.draft_token_ids[:j]
            forbidden = entry.forbidden_token_ids if num_outputs + j < params.min_tokens else []
            rows.append(
                RowSamplingInput(
                    params=params,
                    generator=generators[j],
                    prompt_token_ids=entry.prompt_token_ids,
                    output_token_ids=outputs,
                    block_ids_for_min_tokens=forbidden,
                    grammar_bitmask=None if first_mask is None else grammar.bitmask[first_mask + j],  # type: ignore[union-attr]
                )
            )
    metadata = build_sampling_metadata(rows, device)
    verified = verify_drafts(logits, metadata, [entry.draft_token_ids for entry in entries])
    for i, entry in enumerate(entries):
        tokens = verified.token_ids[i]
        output.sampled_token_ids[entry.request_id] = tokens[0]
        output.verified_token_ids[entry.request_id] = tokens
        num = entry.sampling_params.logprobs
        if verified.logprobs is None or num is None:
            continue
        positions = [
            PositionLogprobs(token_ids=ids[: num + 1], logprobs=values[: num + 1], rank=rank)
            for ids, values, rank in verified.logprobs[i]
        ]
        output.logprobs[entry.request_id] = positions[0]
        output.verified_logprobs[entry.request_id] = positions


def draft_contexts(
    entries: list[ScheduledRequest], output: ModelRunnerOutput, max_drafts: int
) -> list[DraftContext]:
    """One context per sampled entry: prompt, outputs sent with the plan, and this step's tokens."""
    contexts = []
    for entry in entries:
        new = output.verified_token_ids.get(entry.request_id)
        if new is None:
            new = [output.sampled_token_ids[entry.request_id]]
        tokens = entry.prompt_token_ids + entry.output_token_ids + new
        contexts.append(DraftContext(entry.request_id, tokens, max_drafts))
    return contexts
