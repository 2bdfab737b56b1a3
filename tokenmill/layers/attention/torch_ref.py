"""Reference paged attention in plain torch: write new K/V to their slots, gather, attend.

Runs on any device. Each group's keys and values are gathered from the paged cache into a padded
``[S, K, kv_heads, head_dim]`` layout and attended with ``scaled_dot_product_attention`` under the
group's mask, so there is no Python loop over requests. Faster backends are tested against this one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tokenmill.layers.attention.backend import AttentionBackend, SequenceStep
from tokenmill.layers.attention.decode_group import build_decode_group
from tokenmill.layers.attention.metadata import AttentionGroup, AttentionMetadata

# Prompt groups whose longest chunk has at least this many tokens attend one sequence at a time:
# the per-call overhead is then small next to the attention, and causal chunks skip half the scores.
PER_SEQUENCE_MIN_QUERIES = 256


class TorchReferenceBackend(AttentionBackend):
    """The reference ``AttentionBackend``: runs on any device, every other backend is tested against it.

    Its metadata puts a step's decodes (one new token each) in one padded group and its prompt chunks
    in another (``AttentionGroup``: gather indices, a causal mask within each sequence's window, block
    tables and spans for kernels that read the cache in place). Faster backends may subclass it, keep
    its metadata and replace ``_attend_group`` for the groups they handle.
    """

    name = "torch"

    @classmethod
    def build_metadata(
        cls,
        sequences: Sequence[SequenceStep],
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        block_size: int,
        sliding_windows: Sequence[int | None],
    ) -> dict[int | None, AttentionMetadata]:
        decodes = [s for s in sequences if s.num_new_tokens == 1]
        chunks = [s for s in sequences if s.num_new_tokens > 1]
        device = slot_mapping.device
        return {
            window: AttentionMetadata(
                slot_mapping=slot_mapping,
                groups=[
                    (build_decode_group if members is decodes else build_group)(
                        members, block_size, window, device
                    )
                    for members in (decodes, chunks)
                    if members
                ],
            )
            for window in dict.fromkeys(sliding_windows)
        }

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        sinks: torch.Tensor | None = None,  # [num_heads]
    ) -> torch.Tensor:
        self._store_kv(key, value, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
        for group in metadata.groups:
            if sinks is None:
                self._attend_group(query, kv_cache, group, out)
            else:
                self._attend_group_with_sinks(query, kv_cache, group, out, sinks)
        return out

    def _store_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None:
        """Write this step's keys and values to their slots."""
        key_cache = kv_cache[0].view(-1, self.num_kv_heads, self.head_dim)  # [num_slots, kv_heads, head_dim]
        value_cache = kv_cache[1].view(-1, self.num_kv_heads, self.head_dim)
        key_cache.index_copy_(0, slot_mapping, key.to(key_cache.dtype))
        value_cache.index_copy_(0, slot_mapping, value.to(value_cache.dtype))

    def _attend_group(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        group: AttentionGroup,
        out: torch.Tensor,  # [num_tokens, num_heads, head_dim], this group's rows written here
    ) -> None:
        """Gather the group's K/V into a padded batch and attend under its mask; groups of long chunks
        attend one sequence at a time instead (see ``_attend_each_sequence``)."""
        key_cache = kv_cache[0].view(-1, self.num_kv_heads, self.head_dim)  # [num_slots, kv_heads, head_dim]
        value_cache = kv_cache[1].view(-1, self.num_kv_heads, self.head_dim)
        if group.spans is not None and group.num_queries >= PER_SEQUENCE_MIN_QUERIES:
            self._attend_each_sequence(query, key_cache, value_cache, group, out)
            return
        num_seqs, num_queries = group.query_rows.shape
        num_keys = group.kv_slots.shape[1]
        # index_select on a flat index is several times faster than advanced indexing on CPU.
        q = query.index_select(0, group.query_rows.view(-1))  # [S*Q, num_heads, head_dim]
        q = q.view(num_seqs, num_queries, self.num_heads, self.head_dim).transpose(1, 2)  # [S, H, Q, D]
        flat_slots = group.kv_slots.view(-1)  # [S*K]
        k = key_cache.index_select(0, flat_slots).view(num_seqs, num_keys, self.num_kv_heads, self.head_dim)
        v = value_cache.index_select(0, flat_slots).view(num_seqs, num_keys, self.num_kv_heads, self.head_dim)
        attended = F.scaled_dot_product_attention(
            q,
            k.transpose(1, 2).to(q.dtype),  # [S, kv_heads, K, head_dim]
            v.transpose(1, 2).to(q.dtype),  # [S, kv_heads, K, head_dim]
            attn_mask=group.additive_mask(q.dtype),
            scale=self.scale,
            enable_gqa=True,
        )  # [S, num_heads, Q, head_dim]
        attended = attended.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)  # [S*Q, H, D]
        if num_queries == 1:
            out.index_copy_(0, group.valid_rows, attended)
        else:
            out.index_copy_(0, group.valid_rows, attended.index_select(0, group.valid_index))

    def _attend_each_sequence(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
        group: AttentionGroup,
        out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    ) -> None:
        """One SDPA call per sequence, over exactly its keys: no padding, and a chunk that starts the
        sequence runs as plain causal attention, which skips the masked half of the scores (the padded
        batch computes every score and masks it). Later chunks use their rows of the group's mask."""
        assert group.spans is not None
        for s, (row, start, num_new) in enumerate(group.spans):
            num_keys = start + num_new
            slots = group.kv_slots[s, :num_keys]  # [K]
            q = query[row : row + num_new].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            k = (
                key_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
            )  # [1, kv_heads, K, D]
            v = (
                value_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
            )  # [1, kv_heads, K, D]
            if start == 0:
                attended = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.scale, enable_gqa=True
                )  # [1, H, n, D]
            else:
                mask = group.additive_mask(q.dtype)[s : s + 1, :, :num_new, :num_keys]  # [1, 1, n, K]
                attended = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True
                )  # [1, H, n, D]
            out[row : row + num_new] = attended[0].transpose(0, 1)  # [n, H, D]

    def _attend_group_with_sinks(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        group: AttentionGroup,
        out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        sinks: torch.Tensor,  # [num_heads]
    ) -> None:
        """The group's attention with a sink logit per head in every softmax denominator, computed
        eagerly as transformers' gpt-oss does (SDPA has no sinks). Groups of long chunks attend one
        sequence at a time over exactly its keys, so the score matrix never spans the padded batch."""
        key_cache = kv_cache[0].view(-1, self.num_kv_heads, self.head_dim)  # [num_slots, kv_heads, head_dim]
        value_cache = kv_cache[1].view(-1, self.num_kv_heads, self.head_dim)
        mask = group.additive_mask(torch.float32)  # [S, 1, Q, K]
        if group.spans is not None and group.num_queries >= PER_SEQUENCE_MIN_QUERIES:
            for s, (row, start, num_new) in enumerate(group.spans):
                slots = group.kv_slots[s, : start + num_new]  # [K]
                q = query[row : row + num_new].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
                k = key_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)  # [1, kv_heads, K, D]
                v = value_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)  # [1, kv_heads, K, D]
                seq_mask = mask[s : s + 1, :, :num_new, : start + num_new]  # [1, 1, n, K]
                attended = self._eager_with_sinks(q, k, v, seq_mask, sinks)  # [1, H, n, D]
                out[row : row + num_new] = attended[0].transpose(0, 1).to(out.dtype)
            return
        num_seqs, num_queries = group.query_rows.shape
        num_keys = group.kv_slots.shape[1]
        q = query.index_select(0, group.query_rows.view(-1))  # [S*Q, num_heads, head_dim]
        q = q.view(num_seqs, num_queries, self.num_heads, self.head_dim).transpose(1, 2)  # [S, H, Q, D]
        flat_slots = group.kv_slots.view(-1)  # [S*K]
        shape = (num_seqs, num_keys, self.num_kv_heads, self.head_dim)
        k = key_cache.index_select(0, flat_slots).view(shape).transpose(1, 2)  # [S, kv_heads, K, D]
        v = value_cache.index_select(0, flat_slots).view(shape).transpose(1, 2)  # [S, kv_heads, K, D]
        attended = self._eager_with_sinks(q, k, v, mask, sinks)  # [S, H, Q, D]
        attended = attended.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)  # [S*Q, H, D]
        if num_queries > 1:
            attended = attended.index_select(0, group.valid_index)
        out.index_copy_(0, group.valid_rows, attended.to(out.dtype))

    def _eager_with_sinks(
        self,
        q: torch.Tensor,  # [S, num_heads, Q, head_dim]
        k: torch.Tensor,  # [S, kv_heads, K, head_dim]
        v: torch.Tensor,  # [S, kv_heads, K, head_dim]
        mask: torch.Tensor,  # [S, 1, Q, K] float32, 0 or -inf
        sinks: torch.Tensor,  # [num_heads]
    ) -> torch.Tensor:
        """``softmax([scores, sink])`` without the sink's column, times the values: ``[S, H, Q, D]``.
        The softmax runs in float32; a fully masked (padding) row keeps only the sink, so no NaN."""
        repeats = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(repeats, dim=1).to(q.dtype)  # [S, H, K, D]
        v = v.repeat_interleave(repeats, dim=1).to(q.dtype)  # [S, H, K, D]
        scores = torch.matmul(q, k.transpose(2, 3)).float() * self.scale + mask  # [S, H, Q, K]
        sink = sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)  # [S, H, Q, 1]
        combined = torch.cat([scores, sink], dim=-1)  # [S, H, Q, K + 1]
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1)[..., :-1]  # [S, H, Q, K]
        return torch.matmul(probs.to(v.dtype), v)  # [S, H, Q, D]


def build_group(
    members: Sequence[SequenceStep], block_size: int, sliding_window: int | None, device: torch.device
) -> AttentionGroup:
    """Padded gather indices and the causal mask for sequences attended together.

    ``sliding_window`` (None: full attention) limits each query to that many trailing positions,
    itself included. Block-table entries the KV manager released (negative: outside every layer's
    window) read block 0 and are always masked out.
    """
    bs = block_size
    num_new = torch.tensor([s.num_new_tokens for s in members], dtype=torch.long)  # [S]
    starts = torch.tensor([s.start_position for s in members], dtype=torch.long)  # [S]
    row_offsets = torch.tensor([s.row_offset for s in members], dtype=torch.long)  # [S]
    num_queries = int(num_new.max())
    num_keys = int((starts + num_new).max())
    max_blocks = -(-num_keys // bs)
    tables = torch.zeros(len(members), max_blocks, dtype=torch.long)  # [S, max_blocks]
    for row, sequence in enumerate(members):
        table = list(sequence.block_table[:max_blocks])
        tables[row, : len(table)] = torch.tensor(table, dtype=torch.long).clamp_(min=0)

    q_index = torch.arange(num_queries)  # [Q]
    valid = q_index[None, :] < num_new[:, None]  # [S, Q]
    query_rows = torch.where(valid, row_offsets[:, None] + q_index[None, :], 0)  # [S, Q]

    def gather_plan() -> tuple[torch.Tensor, torch.Tensor]:
        key_index = torch.arange(num_keys)  # [K]
        kv_slots = tables[:, key_index // bs] * bs + key_index % bs  # [S, K]
        query_pos = starts[:, None] + q_index[None, :]  # [S, Q]
        mask = (key_index[None, None, :] <= query_pos[:, :, None]) & valid[:, :, None]  # [S, Q, K]
        if sliding_window is not None:
            # A query sees only the last `sliding_window` positions, itself included.
            mask &= key_index[None, None, :] > query_pos[:, :, None] - sliding_window
        return kv_slots.to(device), mask.unsqueeze(1).to(device)  # [S, K], [S, 1, Q, K]

    valid_index = valid.reshape(-1).nonzero().squeeze(1)  # [num_valid]
    return AttentionGroup(
        query_rows=query_rows.to(device),
        gather_plan=gather_plan,
        valid_rows=query_rows.reshape(-1)[valid_index].to(device),
        valid_index=valid_index.to(device),
        num_queries=num_queries,
        block_tables=tables.to(device),
        seq_lens=(starts + num_new).to(device),
        sliding_window=sliding_window,
        spans=[(s.row_offset, s.start_position, s.num_new_tokens) for s in members],
    )
