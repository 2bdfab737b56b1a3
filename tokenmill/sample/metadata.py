"""Per-step sampling inputs, one row per sequence that samples a token this step.

Built by the model runner from the scheduled requests; consumed by :class:`tokenmill.sample.sampler.Sampler`.
Rows are in the order of the logits passed to the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one step.

    Tensors are on the logits' device. ``temperature`` 0 marks a greedy row. ``top_k`` -1 or 0,
    ``top_p`` 1.0 and ``min_p`` 0.0 mark a row without that filter; the optional tensors are None
    when no row in the batch uses the feature (so the fast path does no work).
    ``generators[row]`` is that row's own seeded generator: a seeded row draws its randomness only
    from it, so its samples do not depend on what else is in the batch.
    ``prompt_token_ids`` / ``output_token_ids`` feed the penalties (repetition applies to both, as
    in transformers and vLLM; presence and frequency only to the output).
    ``min_tokens_block[row]`` lists token ids to forbid on that row this step (EOS and stop ids
    while fewer than ``min_tokens`` have been generated).
    ``max_num_logprobs`` is the largest top-N any row asked for, or None if no row wants logprobs.
    ``grammar_rows`` lists the rows constrained by a grammar and ``grammar_bitmask`` their allowed
    tokens (bit ``t % 32`` of word ``t // 32``); both None when no row is constrained.
    """

    temperature: torch.Tensor  # [num_rows] float32
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [num_rows] int64
    top_p: torch.Tensor | None  # [num_rows] float32
    min_p: torch.Tensor | None  # [num_rows] float32
    generators: dict[int, torch.Generator]
    presence_penalty: torch.Tensor | None  # [num_rows] float32
    frequency_penalty: torch.Tensor | None  # [num_rows] float32
    repetition_penalty: torch.Tensor | None  # [num_rows] float32
    prompt_token_ids: list[list[int]] | None
    output_token_ids: list[list[int]] | None
    logit_bias: list[dict[int, float] | None] | None
    min_tokens_block: dict[int, list[int]]
    max_num_logprobs: int | None
    grammar_rows: torch.Tensor | None = None  # [num_constrained] int64
    grammar_bitmask: torch.Tensor | None = None  # [num_constrained, ceil(vocab / 32)] int32

    @property
    def no_penalties(self) -> bool:
        return (
            self.presence_penalty is None
            and self.frequency_penalty is None
            and self.repetition_penalty is None
        )


@dataclass
class SamplerOutput:
    """What the sampler returns for one step.

    ``logprob_token_ids[row, 0]`` is the sampled token and ``[row, 1:]`` the top-N alternatives in
    descending order; ``logprobs`` holds their log-probabilities under the model's raw distribution
    (log-softmax of the unprocessed logits, as vLLM and OpenAI report them); ``sampled_rank[row]`` is
    the sampled token's rank in that distribution (1 = most likely). All three are None when no row
    asked for logprobs.
    """

    sampled_token_ids: torch.Tensor  # [num_rows] int64
    logprob_token_ids: torch.Tensor | None  # [num_rows, 1 + max_num_logprobs] int64
    logprobs: torch.Tensor | None  # [num_rows, 1 + max_num_logprobs] float32
    sampled_rank: torch.Tensor | None  # [num_rows] int64
