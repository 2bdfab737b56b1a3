"""Build one step's :class:`SamplingMetadata` from the rows the model runner is about to sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.core.step_io import ScheduledRequest
from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sampling_params import SamplingParams

# Temperatures below this are treated as greedy: dividing logits by them overflows float32.
_GREEDY_TEMPERATURE = 1e-5


@dataclass
class RowSamplingInput:
    """One row of the sampler's batch, as the model runner knows it.

    ``generator`` is the request's seeded generator (see :func:`make_generator`), or None to use the
    default RNG; it must live on the device the sampler runs on and persist across steps so that
    successive draws continue one stream. ``block_ids_for_min_tokens`` are the token ids to forbid this
    step (EOS and stop ids while fewer than ``min_tokens`` tokens have been generated), else empty.
    The token id lists are read only, never copied into tensors unless a penalty needs them.
    ``grammar_bitmask`` is the row's allowed-token bitmask (``[ceil(vocab / 32)]`` int32) when a
    grammar constrains it, else None.
    """

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids_for_min_tokens: list[int]
    grammar_bitmask: torch.Tensor | None = None


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``: the only randomness a seeded request uses."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def position_generator(
    entry: ScheduledRequest, default_seed: int, device: torch.device | str, row: int = 0
) -> torch.Generator:
    """The deterministic mode's generator for sampling row ``row`` of ``entry`` (row ``j`` of a
    drafted entry samples the token after draft ``j``; an undrafted entry has row 0 only): seeded
    from the request's seed (its sibling's, see the scheduler; ``default_seed`` when the request has
    none) and the position of the token the row samples, so a draw depends on nothing but the request
    and the position: not on earlier draws, preemption, jump-forward, speculative drafts or the rest
    of the batch."""
    seed = default_seed if entry.seed is None else entry.seed
    position = entry.end_position - len(entry.draft_token_ids) + row
    mixed = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) % 2**64
    return make_generator(mixed, device)


def _is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _GREEDY_TEMPERATURE


def draws_random(params: SamplingParams) -> bool:
    """Whether a row with these parameters draws a random number when sampled (greedy rows draw none)."""
    return not _is_greedy(params)


def build_sampling_metadata(rows: list[RowSamplingInput], device: torch.device | str) -> SamplingMetadata:
    """Gather per-row sampling settings into batched tensors on ``device``.

    Called once per step, so it stays cheap: a feature no row uses gets None (and costs nothing in the
    sampler), filter settings of greedy rows are neutralised (they do not affect an argmax), generators
    are kept only for random rows, and token id lists are passed on only for rows with a penalty.
    """
    params = [row.params for row in rows]
    greedy = [_is_greedy(p) for p in params]

    # Greedy rows get neutral filter values: filters cannot change an argmax.
    temperatures: list[float] = []
    top_ks: list[int] = []
    top_ps: list[float] = []
    min_ps: list[float] = []
    generators: dict[int, torch.Generator] = {}
    for i, (row, p, is_greedy) in enumerate(zip(rows, params, greedy, strict=True)):
        temperatures.append(0.0 if is_greedy else p.temperature)
        top_ks.append(-1 if is_greedy else p.top_k)
        top_ps.append(1.0 if is_greedy else p.top_p)
        min_ps.append(0.0 if is_greedy else p.min_p)
        if not is_greedy and row.generator is not None:
            generators[i] = row.generator

    # Each per-row tensor below is [num_rows], or None when no row uses that feature.
    f32, i64 = torch.float32, torch.int64
    temperature = torch.tensor(temperatures, dtype=f32, device=device)  # [num_rows]
    top_k = torch.tensor(top_ks, dtype=i64, device=device) if any(k > 0 for k in top_ks) else None
    top_p = torch.tensor(top_ps, dtype=f32, device=device) if any(x < 1.0 for x in top_ps) else None
    min_p = torch.tensor(min_ps, dtype=f32, device=device) if any(x > 0.0 for x in min_ps) else None

    # Penalties shape greedy rows too, so every row counts here.
    presences = [p.presence_penalty for p in params]
    frequencies = [p.frequency_penalty for p in params]
    repetitions = [p.repetition_penalty for p in params]
    uses_repetition = [r != 1.0 for r in repetitions]
    uses_penalty = [
        a != 0.0 or b != 0.0 or c for a, b, c in zip(presences, frequencies, uses_repetition, strict=True)
    ]
    presence_penalty = torch.tensor(presences, dtype=f32, device=device) if any(presences) else None
    frequency_penalty = torch.tensor(frequencies, dtype=f32, device=device) if any(frequencies) else None
    repetition_penalty = torch.tensor(repetitions, dtype=f32, device=device) if any(uses_repetition) else None

    # Rows without a penalty send empty lists so they do not widen the padded id tensors.
    output_token_ids = prompt_token_ids = None
    if any(uses_penalty):
        output_token_ids = [
            row.output_token_ids if u else [] for row, u in zip(rows, uses_penalty, strict=True)
        ]
    if repetition_penalty is not None:
        prompt_token_ids = [
            row.prompt_token_ids if u else [] for row, u in zip(rows, uses_repetition, strict=True)
        ]

    logit_bias = None
    if any(p.logit_bias for p in params):
        logit_bias = [p.logit_bias or None for p in params]

    min_tokens_block = {
        i: row.block_ids_for_min_tokens for i, row in enumerate(rows) if row.block_ids_for_min_tokens
    }

    constrained = [i for i, row in enumerate(rows) if row.grammar_bitmask is not None]
    grammar_rows = grammar_bitmask = None
    if constrained:
        grammar_rows = torch.tensor(constrained, dtype=i64, device=device)  # [num_constrained]
        masks = [row.grammar_bitmask for row in rows if row.grammar_bitmask is not None]
        grammar_bitmask = torch.stack(masks).to(device)  # [num_constrained, words]

    requested = [p.logprobs for p in params if p.logprobs is not None]
    max_num_logprobs = max(requested) if requested else None

    return SamplingMetadata(
        temperature=temperature,
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        generators=generators,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty,
        prompt_token_ids=prompt_token_ids,
        output_token_ids=output_token_ids,
        logit_bias=logit_bias,
        min_tokens_block=min_tokens_block,
        max_num_logprobs=max_num_logprobs,
        grammar_rows=grammar_rows,
        grammar_bitmask=grammar_bitmask,
    )
