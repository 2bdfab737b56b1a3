"""Multi-head latent attention backends: the absorbed form (decodes) against the expanded form and
against plain attention over explicitly expanded keys and values; the CPU kernel path against the
reference. Random latent caches with several sequences of different lengths, block tables out of
order, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers.attention import SequenceStep, TorchReferenceBackend
from tokenmill.layers.attention.mla import MLAReferenceBackend
from tokenmill.layers.cpu_kernels import load_error
from tokenmill.layers.linear import ColumnParallelLinear

HEADS, RANK, NOPE, ROPE, VDIM, BLOCK = 4, 32, 16, 8, 12, 4
SCALE = (NOPE + ROPE) ** -0.5


def _setup(dtype: torch.dtype, lengths: list[int], new: list[int], rank: int = RANK, rope: int = ROPE):  # type: ignore[no-untyped-def]
    """A cache holding ``lengths[s] - new[s]`` earlier tokens per sequence, the step's inputs for its
    ``new[s]`` tokens, the metadata, and a ``kv_b_proj``."""
    generator = torch.Generator().manual_seed(0)
    kv_b = ColumnParallelLinear(rank, HEADS * (NOPE + VDIM), dtype=dtype)
    kv_b.weight.data.copy_(torch.randn(kv_b.weight.shape, generator=generator) / rank**0.5)
    num_blocks = sum(-(-n // BLOCK) for n in lengths) + 2
    cache = torch.randn(1, num_blocks, BLOCK, 1, rank + rope, generator=generator).to(dtype)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    sequences, slots, row = [], [], 0
    for length, count in zip(lengths, new):
        table = [order.pop() for _ in range(-(-length // BLOCK))]
        start = length - count
        sequences.append(SequenceStep(row, start, count, table))
        slots.extend(table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, length))
        row += count
    slot_mapping = torch.tensor(slots)
    metadata = TorchReferenceBackend.build_metadata(sequences, slot_mapping, BLOCK, [None])[None]
    n = row
    inputs = (
        torch.randn(n, HEADS, NOPE, generator=generator).to(dtype),
        torch.randn(n, HEADS, rope, generator=generator).to(dtype),
        torch.randn(n, rank, generator=generator).to(dtype),
        torch.randn(n, rope, generator=generator).to(dtype),
    )
    return kv_b, cache, metadata, sequences, inputs


def _explicit(kv_b, cache, sequences, inputs) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Plain per-head attention over keys and values expanded from the (already updated) cache."""
    q_nope, q_rope, _, _ = (t.double() for t in inputs)
    weight = kv_b.weight.double()
    flat = cache[0].reshape(-1, RANK + ROPE).double()
    out = []
    for seq in sequences:
        positions = range(seq.start_position + seq.num_new_tokens)
        latent = flat[[seq.block_table[p // BLOCK] * BLOCK + p % BLOCK for p in positions]]  # [K, W]
        kv = (latent[:, :RANK] @ weight.T).view(-1, HEADS, NOPE + VDIM)
        keys = torch.cat([kv[..., :NOPE], latent[:, None, RANK:].expand(-1, HEADS, ROPE)], -1)
        rows = slice(seq.row_offset, seq.row_offset + seq.num_new_tokens)
        query = torch.cat([q_nope[rows], q_rope[rows]], -1)  # [n, H, D]
        mask = torch.ones(seq.num_new_tokens, len(positions), dtype=torch.bool).tril(seq.start_position)
        out.append(
            F.scaled_dot_product_attention(
                query.transpose(0, 1),
                keys.transpose(0, 1),
                kv[..., NOPE:].transpose(0, 1),
                attn_mask=mask,
                scale=SCALE,
            ).transpose(0, 1)
        )
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_absorbed_decode_and_expanded_chunks_equal_explicit_attention(dtype: torch.dtype) -> None:
    # Two decodes and two prompt chunks (one starting its sequence, one after cached tokens).
    kv_b, cache, metadata, sequences, inputs = _setup(dtype, [9, 17, 6, 13], [1, 1, 6, 5])
    backend = MLAReferenceBackend(HEADS, RANK, NOPE, ROPE, VDIM, SCALE, kv_b)
    out = backend.forward(*inputs, cache, metadata)
    expected = _explicit(kv_b, cache, sequences, inputs)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)
    # The verification form: every row absorbed.
    metadata.rows_as_decodes_preferred = True
    again = backend.forward(*inputs, cache, metadata)
    torch.testing.assert_close(again.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.skipif(load_error() is not None, reason="the CPU kernels do not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank,rope", [(RANK, ROPE), (512, 64)])  # the second: DeepSeek-V3's 576
def test_cpu_kernel_decode_matches_the_reference(dtype: torch.dtype, rank: int, rope: int) -> None:
    from tokenmill.layers.attention.mla_cpu import MLACpuBackend

    kv_b, cache, metadata, _, inputs = _setup(dtype, [9, 17, 3, 30, 1], [1, 1, 1, 1, 1], rank, rope)
    reference = MLAReferenceBackend(HEADS, rank, NOPE, rope, VDIM, SCALE, kv_b)
    fast = MLACpuBackend(HEADS, rank, NOPE, rope, VDIM, SCALE, kv_b)
    expected = reference.forward(*inputs, cache.clone(), metadata)
    group = metadata.groups[0]
    assert fast._kernel_takes(inputs[0], cache, group)
    out = fast.forward(*inputs, cache, metadata)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)
