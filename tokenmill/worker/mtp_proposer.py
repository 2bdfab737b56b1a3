"""The ``mtp`` proposer: DeepSeek-V3's multi-token-prediction layer drafts from the target's hidden states.

The MTP layer (``models/deepseek_mtp.py``) at position ``p`` needs the target's final hidden state at
``p`` and the token at ``p + 1``. So the model runner hands this proposer every step's hidden states
(``record``: one row per scheduled token, with the token it was computed for), and at ``propose`` the
proposer runs the layer over each request's positions it has not computed yet, up to the one before
the newest token: the last of those rows' logits give the first draft. Further drafts chain the layer
on its own output (its hidden state stands in for the target's, which does not exist yet), one row a
step, as far as ``num_speculative_tokens`` and ``draft_confidence`` allow.

A recorded row counts only while its token is still the sequence's token at its position: rows of
rejected drafts are dropped (a rejected draft never equals the token that replaced it). Positions the
target never computed (a prefix-cache hit) have no hidden state; the layer sees zeros there, which
makes those drafts worse but never the output: drafts are a deterministic function of what the
proposer saw, a point mass for the rejection sampler, as for ``draft_model``.

The layer's KV cache is a one-layer latent cache of its own with the target's block count; blocks are
handed out as in ``worker/draft_model.py`` (least recently drafted requests give theirs back first; a
request that still does not fit gets no drafts this step).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from tokenmill.config import EngineConfig
from tokenmill.core.step_io import ScheduledRequest
from tokenmill.layers.attention.backend import SequenceStep
from tokenmill.layers.attention.torch_ref import TorchReferenceBackend
from tokenmill.layers.forward_batch import ForwardBatch
from tokenmill.loader import ModelSource
from tokenmill.models.base import CausalLM
from tokenmill.models.deepseek_mtp import DeepseekV3MTPLayer
from tokenmill.models.deepseek_v3 import DeepseekV3ForCausalLM
from tokenmill.spec.proposer import DraftContext
from tokenmill.worker.kv_cache import allocate_kv_caches

logger = logging.getLogger(__name__)


@dataclass
class _Recorded:
    """Hidden states the target computed for one request: row ``i`` is position ``start + i``,
    computed for token ``token_ids[i]``."""

    start: int
    token_ids: list[int]
    hidden: torch.Tensor  # [n, hidden_size]


@dataclass
class _MTPState:
    """How many leading positions the layer's cache holds for the request, and its block table."""

    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    recorded: list[_Recorded] = field(default_factory=list)


class MTPProposer:
    """Drafts with the checkpoint's first MTP layer (see the module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        target: CausalLM,
        num_blocks: int,
        kv_dtype: torch.dtype,
    ) -> None:
        if not isinstance(target, DeepseekV3ForCausalLM):
            raise ValueError(
                f"speculative method 'mtp' needs a native model with multi-token-prediction layers "
                f"(DeepSeek-V3, Kimi K2); {type(target).__name__} has none"
            )
        if target.args.num_nextn_predict_layers < 1:
            raise ValueError("speculative method 'mtp': this checkpoint has no multi-token-prediction layer")
        spec = config.speculative_config
        assert spec is not None
        self.draft_confidence = spec.draft_confidence
        self.block_size = config.cache.block_size
        device = target.lm_head.weight.device
        dtype = target.lm_head.weight.dtype
        with torch.device(device):
            self.layer = DeepseekV3MTPLayer(source.hf_config, target, 0, dtype)
        self.layer.to(dtype)
        self.layer.load_weights(source.iter_weights(only=target.is_mtp_tensor))  # reads no other tensor
        self.layer.eval()
        spec_of_cache = target.kv_cache_spec
        self.kv_cache = allocate_kv_caches(
            num_blocks,
            num_layers=1,
            block_size=self.block_size,
            num_kv_heads=spec_of_cache.num_kv_heads,
            head_dim=spec_of_cache.head_dim,
            dtype=kv_dtype,
            device=device,
            num_planes=spec_of_cache.num_planes,
        )
        self.device = device
        self.free_blocks = list(range(num_blocks))
        self.states: OrderedDict[str, _MTPState] = OrderedDict()  # least recently drafted first
        logger.info(
            "mtp drafter: multi-token-prediction layer %d of the checkpoint", self.layer.checkpoint_layer
        )

    # ------------------------------------------------------------------ the runner's side

    def record(self, entries: list[ScheduledRequest], hidden: torch.Tensor) -> None:
        """Keep this step's hidden states ``[num_tokens, hidden_size]`` (rows in ``entries`` order)."""
        row = 0
        for entry in entries:
            count = len(entry.token_ids)
            state = self.states.get(entry.request_id)
            if state is None:
                state = self.states[entry.request_id] = _MTPState()
            state.recorded.append(
                _Recorded(entry.start_position, list(entry.token_ids), hidden[row : row + count].clone())
            )
            row += count

    def drop(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            state = self.states.pop(request_id, None)
            if state is not None:
                self.free_blocks.extend(state.block_table)

    # ------------------------------------------------------------------ drafting

    @torch.inference_mode()
    def propose(self, contexts: list[DraftContext]) -> dict[str, list[int]]:
        in_call = {c.request_id for c in contexts}
        rows: list[tuple[DraftContext, _MTPState, torch.Tensor, list[int]]] = []
        for context in contexts:
            state = self._prepare(context, in_call)
            if state is None:
                continue
            previous, next_tokens = self._catch_up_inputs(context, state)
            if next_tokens:
                rows.append((context, state, previous, next_tokens))
        drafts: dict[str, list[int]] = {}
        if not rows:
            return drafts
        # One step over every request's uncomputed positions; its last rows' logits draft first.
        starts = [state.num_computed for _, state, _, _ in rows]
        hidden, logits = self._run(
            [(s, state.block_table, tokens) for s, (_, state, _, tokens) in zip(starts, rows)],
            torch.cat([previous for _, _, previous, _ in rows]),
        )
        for _, state, _, tokens in rows:
            state.num_computed += len(tokens)
        active = []
        for i, (context, state, _, _) in enumerate(rows):
            token = self._confident(logits[i])
            if token is None:
                continue
            drafts[context.request_id] = [token]
            if context.max_drafts > 1:
                active.append((context, state, hidden[i : i + 1], token))
        # Chained drafts: the layer's own hidden state stands in for the target's.
        while active:
            steps = [
                (state.num_computed + len(drafts[c.request_id]) - 1, state.block_table, [token])
                for c, state, _, token in active
            ]
            hidden, logits = self._run(steps, torch.cat([h for _, _, h, _ in active]))
            still = []
            for i, (context, state, _, _) in enumerate(active):
                token = self._confident(logits[i])
                if token is None:
                    continue
                drafts[context.request_id].append(token)
                if len(drafts[context.request_id]) < context.max_drafts:
                    still.append((context, state, hidden[i : i + 1], token))
            active = still
        return drafts

    def _confident(self, logits: torch.Tensor) -> int | None:
        """The greedy draft, or None when its probability is below ``draft_confidence``."""
        probs = torch.softmax(logits.float(), dim=-1)  # [vocab]
        confidence, token = probs.max(dim=-1)
        if float(confidence) < self.draft_confidence:
            return None
        return int(token)

    def _catch_up_inputs(self, context: DraftContext, state: _MTPState) -> tuple[torch.Tensor, list[int]]:
        """The target hidden states of positions ``num_computed .. len - 2`` (zeros where none was
        recorded for the sequence's token there) and the tokens after them."""
        sequence = context.token_ids
        first, last = state.num_computed, len(sequence) - 2
        hidden_size = self.layer.eh_proj.in_features // 2
        previous = torch.zeros(max(0, last - first + 1), hidden_size, dtype=self.layer.eh_proj.weight.dtype)
        for recorded in state.recorded:  # later steps overwrite earlier rows of the same position
            for i, token in enumerate(recorded.token_ids):
                position = recorded.start + i
                if first <= position <= last and sequence[position] == token:
                    previous[position - first] = recorded.hidden[i]
        state.recorded.clear()
        return previous.to(self.device), list(sequence[first + 1 : last + 2])

    def _run(
        self, steps: list[tuple[int, list[int], list[int]]], previous: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the layer over ``steps`` (start position, block table, next tokens each; rows in order)
        with ``previous`` hidden states; returns each step's last row's hidden state and logits."""
        bs = self.block_size
        sequences: list[SequenceStep] = []
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        for start, table, tokens in steps:
            sequences.append(SequenceStep(len(token_ids), start, len(tokens), table))
            token_ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + len(tokens)))
            last_rows.append(len(token_ids) - 1)
        device = self.device
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        attn = TorchReferenceBackend.build_metadata(sequences, slot_mapping, bs, [None])[None]
        seq_lens = [s.start_position + s.num_new_tokens for s in sequences for _ in range(s.num_new_tokens)]
        batch = ForwardBatch(
            input_ids=torch.tensor(token_ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=device),
            attn=attn,
            kv_caches=self.kv_cache,
            logits_rows=torch.tensor(last_rows, dtype=torch.long, device=device),
        )
        hidden = self.layer(previous, batch.input_ids, batch)[batch.logits_rows]  # [num_steps, hidden]
        return hidden, self.layer.compute_logits(hidden)  # [num_steps, vocab_size]

    def _prepare(self, context: DraftContext, in_call: set[str]) -> _MTPState | None:
        """The request's state, most recently drafted, with blocks for its sequence and its drafts;
        None when the cache cannot hold them."""
        state = self.states.pop(context.request_id, None) or _MTPState()
        self.states[context.request_id] = state
        state.num_computed = min(state.num_computed, len(context.token_ids) - 1)
        needed = -(-(len(context.token_ids) + context.max_drafts) // self.block_size) - len(state.block_table)
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


def needs_hidden_states(proposer: object) -> bool:
    """Whether the runner must hand ``proposer`` every step's hidden states (``record``)."""
    return isinstance(proposer, MTPProposer)
