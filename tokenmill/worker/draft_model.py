"""The ``draft_model`` proposer: a smaller model with the target's vocabulary drafts greedily.

The drafter is a ``ModelRunner`` of its own (its weights, its paged KV cache) in the worker, driven
with plans like the target's. Per request it keeps the tokens whose keys and values its cache holds
and their block table; each call it drops what no longer matches the request's sequence (rejected
drafts), computes the new tokens in one step, then drafts one token a step, greedily, stopping at the
first draft whose own probability is below ``draft_confidence``. Drafts are a deterministic function
of the sequence, a point mass for the rejection sampler, so greedy and seeded outputs are those
without speculation.

Its blocks come from a free list of its own cache: a request's are freed when it finishes
(``drop``); when the cache runs short, the least recently drafted requests give theirs back first,
and a request that still does not fit gets no drafts this step (it is recomputed when it drafts next).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from tokenmill.config import CacheConfig, EngineConfig, ModelConfig
from tokenmill.core.step_io import ScheduledRequest, SchedulerOutput
from tokenmill.loader import resolve_model
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec.proposer import DraftContext

# The drafter's own argmax with its logprob (its confidence); never a penalty, never a stop.
_DRAFT_PARAMS = SamplingParams(temperature=0.0, logprobs=0, max_tokens=None, ignore_eos=True)


@dataclass
class _DraftState:
    """What the drafter's cache holds for one request: its first ``len(tokens)`` tokens' KV."""

    tokens: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)


class DraftModelProposer:
    """Drafts with a smaller model (see the module docstring)."""

    def __init__(self, config: EngineConfig, target_vocab_size: int, num_blocks: int) -> None:
        """``num_blocks``: the drafter's cache holds as many blocks (tokens) as the target's, so every
        running request fits; its bytes scale with the drafter's size."""
        from tokenmill.worker.model_runner import ModelRunner

        spec = config.speculative_config
        assert spec is not None and spec.model is not None
        source = resolve_model(spec.model)
        vocab_size = int(getattr(source.hf_config, "vocab_size", 0) or 0)
        if vocab_size != target_vocab_size:
            raise ValueError(
                f"draft model {spec.model!r} has a vocabulary of {vocab_size} tokens, the target "
                f"{target_vocab_size}: a draft model must share the target's vocabulary"
            )
        draft_config = EngineConfig(
            model=ModelConfig(
                model=spec.model,
                dtype=config.model.dtype,
                device=config.model.device,
                seed=config.model.seed,
                quantization=spec.quantization,
            ),
            cache=CacheConfig(block_size=config.cache.block_size, num_blocks=num_blocks),
            num_threads=config.num_threads,
        )
        self.runner = ModelRunner(draft_config, source)
        self.block_size = config.cache.block_size
        self.draft_confidence = spec.draft_confidence
        self.free_blocks = list(range(self.runner.num_blocks))
        self.states: OrderedDict[str, _DraftState] = OrderedDict()  # least recently drafted first

    def drop(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            state = self.states.pop(request_id, None)
            if state is not None:
                self.free_blocks.extend(state.block_table)

    def propose(self, contexts: list[DraftContext]) -> dict[str, list[int]]:
        active: list[tuple[DraftContext, _DraftState]] = []
        for context in contexts:
            state = self._prepare(context, {c.request_id for c in contexts})
            if state is not None:
                active.append((context, state))
        drafts: dict[str, list[int]] = {c.request_id: [] for c, _ in active}
        # First step: every token the cache lacks (at least the last); then one draft a step.
        feed = {c.request_id: c.token_ids[len(s.tokens) :] for c, s in active}
        for _ in range(max((c.max_drafts for c, _ in active), default=0)):
            if not active:
                break
            entries = [self._entry(c.request_id, feed[c.request_id], s) for c, s in active]
            output = self.runner.execute(SchedulerOutput(scheduled=entries))
            still: list[tuple[DraftContext, _DraftState]] = []
            for context, state in active:
                state.tokens.extend(feed[context.request_id])
                token = output.sampled_token_ids[context.request_id]
                confidence = math.exp(output.logprobs[context.request_id].logprobs[0])
                if confidence < self.draft_confidence:
                    continue
                drafts[context.request_id].append(token)
                feed[context.request_id] = [token]
                if len(drafts[context.request_id]) < context.max_drafts:
                    still.append((context, state))
            active = still
        return {request_id: tokens for request_id, tokens in drafts.items() if tokens}

    def _prepare(self, context: DraftContext, in_call: set[str]) -> _DraftState | None:
        """The request's state with what no longer matches its sequence dropped and blocks for the
        sequence plus its drafts reserved; None when the cache cannot hold them."""
        state = self.states.pop(context.request_id, None) or _DraftState()
        self.states[context.request_id] = state  # most recently drafted
        tokens = context.token_ids
        keep = 0
        limit = min(len(state.tokens), len(tokens) - 1)  # the last token is always fed
        while keep < limit and state.tokens[keep] == tokens[keep]:
            keep += 1
        del state.tokens[keep:]
        needed = -(-(len(tokens) + context.max_drafts) // self.block_size) - len(state.block_table)
        while needed > len(self.free_blocks):
            victim = next((r for r in self.states if r not in in_call), None)
            if victim is None:
                self.drop([context.request_id])
                return None
            self.drop([victim])
        if needed > 0:
            state.block_table.extend(self.free_blocks[-needed:])
            del self.free_blocks[-needed:]
        return state

    def _entry(self, request_id: str, tokens: list[int], state: _DraftState) -> ScheduledRequest:
        return ScheduledRequest(
            request_id=request_id,
            token_ids=tokens,
            start_position=len(state.tokens),
            block_table=state.block_table,
            sample=True,
            sampling_params=_DRAFT_PARAMS,
            prompt_token_ids=[],
            output_token_ids=[],
            forbidden_token_ids=[],
            prompt_logprobs_range=None,
            seed=None,
        )
