"""The CPU paged-attention backend (C++ decode kernel) against the torch reference backend.

Caches are random, block tables are scattered over the pool, and the attention metadata comes from
the backends' own ``build_metadata`` (what the model runner calls each step), so what is tested is
what the engine feeds the kernel.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import build_engine_config
from tokenmill.engine_args import add_engine_args, engine_kwargs
from tokenmill.layers import attention, cpu_kernels
from tokenmill.layers.attention import cpu_paged, select_backend, torch_ref
from tokenmill.layers.attention.backend import SequenceStep
from tokenmill.layers.attention.cpu_paged import CpuPagedBackend
from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.layers.attention.torch_ref import TorchReferenceBackend

# Around block boundaries (16), a single token, and one long sequence. With the tests' one thread, the
# kernel gives 7 sequences a task each, and splits 2 sequences into one task per KV head.
SEQ_LENS = [1, 15, 16, 17, 31, 33, 337]
FEW_SEQ_LENS = [17, 337]
ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module", autouse=True)
def kernel_builds() -> None:
    """On this project's machines the kernel must build: a failure here is a failure, not a skip."""
    assert cpu_kernels.load_error() is None


@pytest.fixture(autouse=True)
def fresh_selection() -> Iterator[None]:
    attention._select.cache_clear()
    yield
    attention._select.cache_clear()


def build_step(
    seq_lens: list[int],
    prompt_chunks: tuple[tuple[int, int], ...],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int = 16,
    window: int | None = None,
    seed: int = 0,
    split_decodes: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One step: a decode token for each ``seq_lens`` entry (its last position) and, for each
    ``(start, length)`` in ``prompt_chunks``, a prompt chunk; every sequence's blocks are scattered.
    Decode rows come first (one consecutive slice) unless ``split_decodes`` puts the prompt chunks
    after the first decode row."""
    generator = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    decodes = [(n - 1, 1) for n in seq_lens]
    # (start position, new tokens) of each sequence, in batch order
    spans = (
        decodes[:1] + list(prompt_chunks) + decodes[1:] if split_decodes else decodes + list(prompt_chunks)
    )
    blocks_needed = [-(-(start + n) // block_size) for start, n in spans]
    num_blocks = sum(blocks_needed) + 7
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    sequences: list[SequenceStep] = []
    slots: list[int] = []
    for (start, n), needed in zip(spans, blocks_needed):
        table = [pool.pop() for _ in range(needed)]
        sequences.append(SequenceStep(len(slots), start, n, table))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
    # Both backends build the same metadata (the CPU one inherits the reference's).
    built = CpuPagedBackend.build_metadata(sequences, torch.tensor(slots), block_size, [window])
    assert built.keys() == {window}
    metadata = built[window]

    num_tokens = len(slots)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.randn(shape, generator=generator).to(dtype)  # [2, num_blocks, bs, kv_heads, head_dim]
    query = torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    return query, key, value, kv_cache, metadata


def run_both(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seq_lens: list[int],
    prompt_chunks: tuple[tuple[int, int], ...] = (),
    block_size: int = 16,
    window: int | None = None,
    split_decodes: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(reference output, kernel output, reference cache after, kernel cache after)."""
    query, key, value, kv_cache, metadata = build_step(
        seq_lens,
        prompt_chunks,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        block_size=block_size,
        window=window,
        split_decodes=split_decodes,
    )
    scale = head_dim**-0.5
    ref_cache, cpu_cache = kv_cache.clone(), kv_cache.clone()
    expected = TorchReferenceBackend(num_heads, num_kv_heads, head_dim, scale).forward(
        query, key, value, ref_cache, metadata
    )
    actual = CpuPagedBackend(num_heads, num_kv_heads, head_dim, scale).forward(
        query, key, value, cpu_cache, metadata
    )
    return expected, actual, ref_cache, cpu_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (8, 2)])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("seq_lens", [SEQ_LENS, FEW_SEQ_LENS], ids=["many", "few"])
def test_decode_matches_reference(
    dtype: torch.dtype,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    window: int | None,
    seq_lens: list[int],
) -> None:
    expected, actual, ref_cache, cpu_cache = run_both(
        num_heads, num_kv_heads, head_dim, dtype, seq_lens, window=window
    )
    assert actual.dtype == dtype
    assert torch.equal(ref_cache, cpu_cache)  # the step's K/V were written exactly as the reference does
    torch.testing.assert_close(actual.float(), expected.float(), atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("split_decodes", [False, True], ids=["decode-slice", "decode-gather"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_odd_head_dim_small_blocks_and_mixed_prompt_chunks(dtype: torch.dtype, split_decodes: bool) -> None:
    """head_dim 24 (not a multiple of the 16-lane vectors), block_size 4 as the engine tests use,
    and prompt chunks in the same step (float32: they take the reference path, their rows must be
    untouched; float16: every row goes through the kernel as a decode of its own), after the decode
    rows (read as one slice) or between them (gathered)."""
    expected, actual, ref_cache, cpu_cache = run_both(
        4,
        2,
        24,
        dtype,
        seq_lens=[1, 3, 4, 5, 22],
        prompt_chunks=((0, 6), (9, 3)),
        block_size=4,
        window=7,
        split_decodes=split_decodes,
    )
    assert torch.equal(ref_cache, cpu_cache)
    torch.testing.assert_close(actual.float(), expected.float(), atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("split_decodes", [False, True], ids=["decodes-first", "chunks-between"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_short_prompt_chunks_attend_through_the_kernel_as_decodes(
    dtype: torch.dtype, split_decodes: bool, window: int | None
) -> None:
    """Chunks of up to SHORT_CHUNK_MAX_QUERIES tokens (one starting its sequence, one over a long
    cached prefix, one at the limit) run with the decodes as one kernel call, each row causal over
    its own prefix: the same as the reference's gather + SDPA. Where the AMX prefill kernel takes
    the chunks (bfloat16, no window) they go through it instead, group by group."""
    chunks = ((0, 5), (300, 17), (40, cpu_paged.SHORT_CHUNK_MAX_QUERIES))
    query, key, value, kv_cache, metadata = build_step(
        [3, 70, 129],
        chunks,
        num_heads=6,
        num_kv_heads=2,
        head_dim=64,
        dtype=dtype,
        window=window,
        split_decodes=split_decodes,
    )
    ref_cache, cpu_cache = kv_cache.clone(), kv_cache.clone()
    expected = TorchReferenceBackend(6, 2, 64, 0.125).forward(query, key, value, ref_cache, metadata)
    actual = CpuPagedBackend(6, 2, 64, 0.125).forward(query, key, value, cpu_cache, metadata)
    prefill_kernel = dtype == torch.bfloat16 and window is None and cpu_kernels.prefill_kernel_available()
    assert (metadata._rows_as_decodes is None) == prefill_kernel  # else the one-call path ran
    assert torch.equal(ref_cache, cpu_cache)
    torch.testing.assert_close(actual.float(), expected.float(), atol=ATOL[dtype], rtol=0)


def test_a_longer_chunk_or_float32_does_not_attend_as_decodes() -> None:
    """Rows as decodes serve short bfloat16 / float16 chunks only: a longer chunk, or a float32 one
    (the reference's SDPA, or the float32 prefill kernel where built), attends group by group."""
    for dtype, chunk in ((torch.bfloat16, cpu_paged.SHORT_CHUNK_MAX_QUERIES + 1), (torch.float32, 4)):
        query, key, value, kv_cache, metadata = build_step(
            [9], ((0, chunk),), num_heads=2, num_kv_heads=2, head_dim=64, dtype=dtype
        )
        ref_cache, cpu_cache = kv_cache.clone(), kv_cache.clone()
        expected = TorchReferenceBackend(2, 2, 64, 0.125).forward(query, key, value, ref_cache, metadata)
        actual = CpuPagedBackend(2, 2, 64, 0.125).forward(query, key, value, cpu_cache, metadata)
        assert metadata._rows_as_decodes is None
        torch.testing.assert_close(actual.float(), expected.float(), atol=ATOL[dtype], rtol=0)


def test_rows_as_decodes_gives_each_row_its_table_and_causal_length() -> None:
    # Batch order: a decode at position 6, a 3-token chunk from 4, a decode at position 0 (block size 4).
    _, _, _, _, metadata = build_step(
        [7, 1],
        ((4, 3),),
        num_heads=2,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.bfloat16,
        block_size=4,
        split_decodes=True,
    )
    tables, seq_lens = metadata.rows_as_decodes()
    assert seq_lens.tolist() == [7, 5, 6, 7, 1]
    decode_group, chunk_group = metadata.groups
    assert decode_group.block_tables is not None and chunk_group.block_tables is not None
    assert torch.equal(tables[0, :2], decode_group.block_tables[0])
    assert torch.equal(tables[4, :1], decode_group.block_tables[1, :1])
    for row in (1, 2, 3):
        assert torch.equal(tables[row, :2], chunk_group.block_tables[0])
    assert metadata.rows_as_decodes()[0] is tables  # built once per step


def test_window_covers_only_the_last_positions() -> None:
    """Changing a key outside the window changes nothing; changing one inside it does."""
    query, key, value, kv_cache, metadata = build_step(
        [50], (), num_heads=2, num_kv_heads=1, head_dim=16, dtype=torch.float32, window=10
    )
    backend = CpuPagedBackend(2, 1, 16, 0.25)
    group = metadata.groups[0]
    assert group.block_tables is not None
    table = group.block_tables[0].tolist()
    base = backend.forward(query, key, value, kv_cache.clone(), metadata)
    for position, changes in ((39, False), (40, True)):
        cache = kv_cache.clone()
        cache[0, table[position // 16], position % 16] += 5.0
        changed = backend.forward(query, key, value, cache, metadata)
        assert (not torch.equal(changed, base)) is changes, position


def test_output_is_bitwise_independent_of_batch_threads_and_index_dtype() -> None:
    """A sequence's output is the same bits whatever else is in the batch (28 sequences run one task
    per sequence, 2 sequences one task per KV head), however many threads run it, and with int32 or
    int64 block tables: each head's sum runs in one fixed order (DESIGN.md section 6, batch invariance)."""
    query, _, _, kv_cache, metadata = build_step(
        SEQ_LENS * 4, (), num_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16
    )
    group = metadata.groups[0]
    tables, lens = group.block_tables, group.seq_lens
    assert tables is not None and lens is not None

    def call(rows: slice, index_dtype: torch.dtype = torch.long) -> torch.Tensor:
        return cpu_kernels.paged_attention_decode(
            query[rows],
            kv_cache[0],
            kv_cache[1],
            tables[rows].to(index_dtype),
            lens[rows].to(index_dtype),
            0.125,
        )

    everything = call(slice(None))
    assert torch.equal(call(slice(5, 7)), everything[5:7])
    assert torch.equal(call(slice(None), torch.int32), everything)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(call(slice(None)), everything)
        assert torch.equal(call(slice(5, 7)), everything[5:7])
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "window"),
    [
        (9, 3, 64, None),
        (8, 8, 128, None),
        (16, 2, 64, None),
        (5, 1, 64, None),
        (4, 2, 64, 49),
        (4, 2, 64, 50),
    ],
)
def test_tile_path_agrees_with_the_vector_path_and_the_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, window: int | None
) -> None:
    """bfloat16 caches of 16-slot blocks with head_dim 64 or 128 take the AMX tile path where the CPU
    allows it: the same attention as the vector path and the reference to bfloat16 precision, over
    chunk tails (1, 15, 17, 31, 33, 337 positions), query-head groups of 1 to 8 (tiles of up to 4
    heads, and the rest), and windows whose range starts on a block (49: 288 of 337) or inside one (50)."""
    query, _, _, kv_cache, metadata = build_step(
        SEQ_LENS, (), num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=torch.bfloat16,
        window=window,
    )  # fmt: skip
    group = metadata.groups[0]
    assert group.block_tables is not None and group.seq_lens is not None
    scale = head_dim**-0.5

    def call(tiles: bool) -> torch.Tensor:
        return cpu_kernels.paged_attention_decode(
            query, kv_cache[0], kv_cache[1], group.block_tables, group.seq_lens, scale, window, tiles=tiles
        )

    tiled, vector = call(True), call(False)
    torch.testing.assert_close(tiled.float(), vector.float(), atol=ATOL[torch.bfloat16], rtol=0)
    if cpu_kernels.attention_tiles_available():
        # AMX ran: the tile path's sums (and its bfloat16 probabilities) are not the vector path's
        # bits, but for the 337-token sequence under the window of 50, whose range starts at 287.
        assert not torch.equal(tiled, vector)
        assert torch.equal(tiled[6], vector[6]) is (window == 50)
    else:
        assert torch.equal(tiled, vector)  # no tiles on this CPU: the vector path served both calls
    expected, actual, ref_cache, cpu_cache = run_both(
        num_heads, num_kv_heads, head_dim, torch.bfloat16, SEQ_LENS, window=window
    )
    assert torch.equal(ref_cache, cpu_cache)
    torch.testing.assert_close(actual.float(), expected.float(), atol=ATOL[torch.bfloat16], rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (4, 4, 64)])
def test_chunks_over_a_cached_prefix_take_the_prefill_kernel_and_match_the_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompt chunks attend through the prefill kernel where the CPU has it for their dtype
    (bfloat16: AVX512-BF16; float32: AVX2 without AVX-512): 66 tokens over 1,024 positions, chunks
    ending inside and on block boundaries, beside decodes; chunks that start their sequence, and
    chunks longer than the reference's per-sequence threshold. Outputs equal the reference's to the
    dtype's precision, and the new K/V are stored exactly. Under a sliding window the reference
    serves the chunks."""
    calls: list[tuple[int, int]] = []
    real = cpu_paged.paged_prefill_attention

    def spy(query, key_cache, value_cache, block_table, start, scale):  # type: ignore[no-untyped-def]
        calls.append((start, query.shape[0]))
        return real(query, key_cache, value_cache, block_table, start, scale)

    taken = cpu_kernels.prefill_kernel_available(dtype)

    monkeypatch.setattr(cpu_paged, "paged_prefill_attention", spy)
    chunks = ((1024, 66), (16, 40), (31, 33), (5, 64))
    expected, actual, ref_cache, cpu_cache = run_both(
        num_heads, num_kv_heads, head_dim, dtype, [17, 300], prompt_chunks=chunks
    )
    assert torch.equal(ref_cache, cpu_cache)
    torch.testing.assert_close(actual.float(), expected.float(), atol=ATOL[dtype], rtol=0)
    assert calls == (list(chunks) if taken else [])
    calls.clear()
    chunks = ((0, 40), (0, 300), (16, 280))
    expected, actual, _, _ = run_both(num_heads, num_kv_heads, head_dim, dtype, [17], prompt_chunks=chunks)
    torch.testing.assert_close(actual.float(), expected.float(), atol=ATOL[dtype], rtol=0)
    assert calls == (list(chunks) if taken else [])
    calls.clear()
    expected, actual, _, _ = run_both(
        num_heads, num_kv_heads, head_dim, dtype, [17], prompt_chunks=((0, 40), (16, 40)), window=24
    )
    torch.testing.assert_close(actual.float(), expected.float(), atol=ATOL[dtype], rtol=0)
    assert calls == []


def test_prefill_kernel_checks_its_inputs() -> None:
    if not cpu_kernels.prefill_kernel_available():
        with pytest.raises(RuntimeError, match="needs a CPU with AVX512-BF16"):
            cpu_kernels.paged_prefill_attention(
                torch.zeros(2, 4, 64, dtype=torch.bfloat16),
                torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16),
                torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16),
                torch.arange(4),
                3,
                0.125,
            )
        return
    query = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="blocks must hold 16 slots, got 8"):
        cpu_kernels.paged_prefill_attention(
            query, cache[:, :8].contiguous(), cache[:, :8].contiguous(), torch.arange(4), 3, 0.1
        )
    assert_prefill_kernel_rejects(query, cache, 32, "head_dim must be 64 or 128, got 32")


def assert_prefill_kernel_rejects(
    query: torch.Tensor, cache: torch.Tensor, bad_dim: int, dim_message: str
) -> None:
    """The prefill kernel's errors for a head_dim it does not take (the first ``bad_dim`` dimensions),
    a chunk past its block table, and a block id outside the cache."""
    with pytest.raises(RuntimeError, match=dim_message):
        cpu_kernels.paged_prefill_attention(
            query[..., :bad_dim].contiguous(),
            cache[..., :bad_dim].contiguous(),
            cache[..., :bad_dim].contiguous(),
            torch.arange(4),
            3,
            0.1,
        )
    with pytest.raises(RuntimeError, match="exceeds the block table"):
        cpu_kernels.paged_prefill_attention(query, cache, cache, torch.arange(1), 15, 0.1)
    with pytest.raises(RuntimeError, match="block id 9 outside the cache"):
        cpu_kernels.paged_prefill_attention(query, cache, cache, torch.tensor([9]), 3, 0.1)


F32_PREFILL_CASES = [
    # (tokens, start, heads, kv_heads, head_dim, block_size)
    (66, 1024, 9, 3, 64, 16),  # a question over a shared prefix: 198 rows a KV head, 5 tasks
    (1, 0, 9, 3, 64, 16),
    (5, 3, 4, 4, 40, 8),  # a head_dim tail of 8 dimensions, 8-slot blocks
    (130, 0, 8, 2, 128, 16),  # a whole prompt, causal from position 0
    (49, 77, 6, 1, 256, 32),  # one KV head for six query heads, the largest head_dim
]


@pytest.mark.parametrize(
    ("tokens", "start", "heads", "kv_heads", "head_dim", "block_size"), F32_PREFILL_CASES
)
def test_float32_prefill_kernel_matches_float64_attention(
    tokens: int, start: int, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    """The float32 prefill kernel (AVX2 builds) against causal attention in float64 over the same
    scattered blocks; each row's result is the same bits whatever chunk it is computed in."""
    generator = torch.Generator().manual_seed(tokens)
    num_blocks = 200
    table = torch.randperm(num_blocks, generator=generator)[: -(-(start + tokens) // block_size)]
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    query = torch.randn(tokens, heads, head_dim, generator=generator)
    scale = head_dim**-0.5
    if not cpu_kernels.prefill_kernel_available(torch.float32):
        with pytest.raises(RuntimeError, match="needs a build for AVX2 and FMA without AVX-512"):
            cpu_kernels.paged_prefill_attention(query, key_cache, value_cache, table, start, scale)
        return
    got = cpu_kernels.paged_prefill_attention(query, key_cache, value_cache, table, start, scale)
    total = start + tokens
    slots = (table[:, None] * block_size + torch.arange(block_size)).flatten()[:total]  # [total]
    keys = key_cache.flatten(0, 1)[slots].transpose(0, 1).double()  # [kv_heads, total, head_dim]
    values = value_cache.flatten(0, 1)[slots].transpose(0, 1).double()
    visible = torch.arange(total)[None, :] <= start + torch.arange(tokens)[:, None]  # [tokens, total]
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1).double(),  # [heads, tokens, head_dim]
        keys.repeat_interleave(heads // kv_heads, dim=0),
        values.repeat_interleave(heads // kv_heads, dim=0),
        attn_mask=visible,
        scale=scale,
    ).transpose(0, 1)  # [tokens, heads, head_dim]
    torch.testing.assert_close(got.double(), expected, atol=2e-6, rtol=0)
    last = tokens - 1  # the chunk's last token alone, as a chunk of one at its position
    alone = cpu_kernels.paged_prefill_attention(
        query[last:], key_cache, value_cache, table, start + last, scale
    )
    assert torch.equal(alone, got[last:])


def test_float32_prefill_kernel_checks_its_inputs() -> None:
    query, cache = torch.zeros(2, 4, 64), torch.zeros(4, 16, 2, 64)
    if not cpu_kernels.prefill_kernel_available(torch.float32):
        with pytest.raises(RuntimeError, match="needs a build for AVX2 and FMA without AVX-512"):
            cpu_kernels.paged_prefill_attention(query, cache, cache, torch.arange(4), 3, 0.125)
        return
    assert_prefill_kernel_rejects(query, cache, 36, "head_dim must be a multiple of 8 up to 256, got 36")
    with pytest.raises(RuntimeError, match="start must be >= 0, got -1"):
        cpu_kernels.paged_prefill_attention(query, cache, cache, torch.arange(4), -1, 0.1)


@pytest.mark.parametrize("num_new", [37, 2, 1])  # row tiles of 16 (the last padded), 6 and 3 query rows
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_kernel_rescales_as_later_positions_score_higher(head_dim: int, num_new: int) -> None:
    """Keys grow along the sequence, so every row's maximum rises at almost every step of 64
    positions (the kernel rescales its sums and outputs each time); a padded last row tile and a
    chunk ending inside a block. Both paths (AMX tiles, AVX512-BF16 vectors) within bfloat16 rounding
    of a float32 reference, and no less accurate than the bfloat16 SDPA the reference path runs."""
    generator = torch.Generator().manual_seed(3)
    start, heads, kv_heads = 300, 6, 2
    total = start + num_new
    num_blocks = (total + 15) // 16
    ramp = torch.linspace(0.0, 6.0, num_blocks * 16).view(num_blocks, 16, 1, 1)
    direction = torch.randn(1, 1, kv_heads, head_dim, generator=generator)
    noise = torch.randn(num_blocks, 16, kv_heads, head_dim, generator=generator)
    # In position order; the cache holds logical block b in block table[b].
    ordered_keys = (ramp * direction + 0.3 * noise).to(torch.bfloat16)
    ordered_values = torch.randn(num_blocks, 16, kv_heads, head_dim, generator=generator).to(torch.bfloat16)
    group = heads // kv_heads
    query = (
        direction.view(1, kv_heads, 1, head_dim)
        .expand(num_new, kv_heads, group, head_dim)
        .reshape(num_new, heads, head_dim)
        + 0.3 * torch.randn(num_new, heads, head_dim, generator=generator)
    ).to(torch.bfloat16)
    table = torch.randperm(num_blocks, generator=generator)
    key_cache, value_cache = torch.empty_like(ordered_keys), torch.empty_like(ordered_values)
    key_cache[table], value_cache[table] = ordered_keys, ordered_values
    keys = ordered_keys.reshape(-1, kv_heads, head_dim)[:total]  # [total, kv_heads, head_dim]
    values = ordered_values.reshape(-1, kv_heads, head_dim)[:total]
    scale = head_dim**-0.5
    allowed = torch.arange(total)[None, :] <= torch.arange(start, total)[:, None]  # [num_new, total]
    mask = torch.zeros(num_new, total).masked_fill(~allowed, float("-inf"))

    def attend(dtype: torch.dtype) -> torch.Tensor:  # [num_new, heads, head_dim] float32
        out = torch.nn.functional.scaled_dot_product_attention(
            query.to(dtype).transpose(0, 1)[None],
            keys.to(dtype).transpose(0, 1)[None],
            values.to(dtype).transpose(0, 1)[None],
            attn_mask=mask.to(dtype),
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1).float()

    reference = attend(torch.float32)
    if not cpu_kernels.prefill_kernel_available():
        with pytest.raises(RuntimeError, match="needs a CPU with AVX512-BF16"):
            cpu_kernels.paged_prefill_attention(query, key_cache, value_cache, table, start, scale)
        return
    sdpa_error = (attend(torch.bfloat16) - reference).abs().mean()
    results = {}
    for tiles in (True, False):  # AMX tiles where granted, and the AVX512-BF16 vectors
        actual = cpu_kernels.paged_prefill_attention(
            query, key_cache, value_cache, table, start, scale, tiles
        )
        torch.testing.assert_close(actual.float(), reference, atol=ATOL[torch.bfloat16], rtol=0)
        kernel_error = (actual.float() - reference).abs().mean()
        assert kernel_error <= 1.25 * sdpa_error, (tiles, kernel_error, sdpa_error)
        results[tiles] = actual
    # The two paths sum in different orders: the same bits only where AMX is not there to differ.
    assert torch.equal(results[True], results[False]) is not cpu_kernels.attention_tiles_available()


def shared_prefix_step(
    dtype: torch.dtype, block_size: int = 16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query, kv_cache, block_tables, seq_lens) of a decode step whose sequences share leading cache
    blocks as the prefix cache shares them: 20 sequences behind one 200-token prefix (12 full blocks,
    more than one group's worth), 3 behind a 64-token one, 2 of those also sharing 3 more blocks, a
    sequence that shares only one block, one shorter than the shared prefix, and 4 lone sequences."""
    rng = random.Random(1)
    num_blocks = 600
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    prefix_a = [pool.pop() for _ in range(200 // block_size)]
    prefix_b = [pool.pop() for _ in range(64 // block_size)]
    prefix_b2 = prefix_b + [pool.pop() for _ in range(3)]
    # (shared blocks, sequence length)
    layout = [(prefix_a, rng.randrange(193, 400)) for _ in range(20)]
    layout += [
        (prefix_b, 64 + 9),
        (prefix_b2, 64 + 3 * block_size + 20),
        (prefix_b2, 64 + 3 * block_size + 1),
    ]
    layout += [(prefix_a[:1], 150), (prefix_a, 100)]
    layout += [([], n) for n in (1, 16, 70, 333)]
    rng.shuffle(layout)
    tables, lens = [], []
    for shared, seq_len in layout:
        needed = -(-seq_len // block_size)
        own = shared[: min(len(shared), seq_len // block_size)]
        tables.append(own + [pool.pop() for _ in range(needed - len(own))])
        lens.append(seq_len)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])  # [S, width]
    generator = torch.Generator().manual_seed(1)
    kv_cache = torch.randn(2, num_blocks, block_size, 3, 64, generator=generator).to(dtype)
    query = torch.randn(len(layout), 9, 64, generator=generator).to(dtype)  # [S, heads, head_dim]
    return query, kv_cache, block_tables, torch.tensor(lens)


def expected_decode(
    query: torch.Tensor,  # [heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
    table: torch.Tensor,  # [blocks]
    seq_len: int,
    scale: float,
    first: int = 0,
) -> torch.Tensor:  # [heads, head_dim]
    """One sequence's decode attention in float32 SDPA over its positions [first, seq_len), its keys
    gathered through its block table."""
    block_size, kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    slots = (table[:, None] * block_size + torch.arange(block_size)).flatten()[first:seq_len]  # [n]
    keys = kv_cache[0].flatten(0, 1)[slots].float().transpose(0, 1)  # [kv_heads, n, head_dim]
    values = kv_cache[1].flatten(0, 1)[slots].float().transpose(0, 1)
    per_kv = query.shape[0] // kv_heads
    return torch.nn.functional.scaled_dot_product_attention(
        query.float()[:, None, :],  # [heads, 1, head_dim]
        keys.repeat_interleave(per_kv, dim=0),  # [heads, n, head_dim]
        values.repeat_interleave(per_kv, dim=0),
        scale=scale,
    )[:, 0]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sequences_sharing_prefix_blocks_read_them_together_with_the_same_result(
    dtype: torch.dtype, threads: int
) -> None:
    """Sequences whose block tables start with the same blocks are attended as a group (the shared
    blocks read once); each one's output is bitwise what it is alone, and matches the reference."""
    query, kv_cache, tables, lens = shared_prefix_step(dtype)

    def call(rows: list[int]) -> torch.Tensor:
        return cpu_kernels.paged_attention_decode(
            query[rows], kv_cache[0], kv_cache[1], tables[rows], lens[rows], 0.125
        )  # [len(rows), heads, head_dim]

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = call(list(range(len(lens))))
        for s in range(len(lens)):
            assert torch.equal(call([s]), together[s : s + 1]), f"sequence {s} differs when grouped"
    finally:
        torch.set_num_threads(previous)
    for s in range(len(lens)):
        expected = expected_decode(query[s], kv_cache, tables[s], int(lens[s]), 0.125)  # [heads, head_dim]
        torch.testing.assert_close(together[s].float(), expected, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("head_dim", [64, 40, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_large_group_gives_each_sequence_its_own_result(dtype: torch.dtype, head_dim: int) -> None:
    """Sixteen sequences over one shared prefix (one group, attended per KV head over two threads)
    and a few own positions each: every sequence's output is bitwise what it is alone and on one
    thread, and matches SDPA, for head sizes with and without compiled-in code (64, 128; 40)."""
    rng = random.Random(3)
    block_size, kv_heads, heads, prefix_blocks = 16, 3, 9, 9
    pool = list(range(400))
    rng.shuffle(pool)
    prefix = [pool.pop() for _ in range(prefix_blocks)]
    lens = [prefix_blocks * block_size + rng.randrange(1, 40) for _ in range(16)]
    tables = torch.tensor([prefix + [pool.pop() for _ in range(3)] for _ in lens])  # [16, 12]
    generator = torch.Generator().manual_seed(4)
    kv_cache = torch.randn(2, 400, block_size, kv_heads, head_dim, generator=generator).to(dtype)
    query = torch.randn(len(lens), heads, head_dim, generator=generator).to(dtype)
    seq_lens = torch.tensor(lens)

    def call(rows: list[int], threads: int) -> torch.Tensor:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return cpu_kernels.paged_attention_decode(
                query[rows], kv_cache[0], kv_cache[1], tables[rows], seq_lens[rows], head_dim**-0.5
            )  # [len(rows), heads, head_dim]
        finally:
            torch.set_num_threads(previous)

    together = call(list(range(len(lens))), threads=2)
    assert torch.equal(together, call(list(range(len(lens))), threads=1))
    for s in range(len(lens)):
        assert torch.equal(call([s], threads=1), together[s : s + 1]), f"sequence {s} differs when grouped"
        expected = expected_decode(query[s], kv_cache, tables[s], lens[s], head_dim**-0.5)
        torch.testing.assert_close(together[s].float(), expected, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("window", [None, 70])
def test_many_tasks_of_mixed_lengths_on_two_threads_each_get_their_own_result(window: int | None) -> None:
    """Forty sequences (each a task on its own; one group of three over a shared prefix), lengths 0
    to 300, on two threads that each take the next task before finishing the current one and
    prefetch its first rows: every sequence's output is bitwise what it is alone on one thread,
    matches the reference, and an empty sequence (block table entries past its length invalid)
    gets zeros."""
    rng = random.Random(11)
    block_size, kv_heads, heads, head_dim = 16, 3, 9, 64
    pool = list(range(1200))
    rng.shuffle(pool)
    prefix = [pool.pop() for _ in range(5)]
    lens = [rng.choice([0, 1, 15, 64, 65, 130, 300]) for _ in range(37)] + [120, 121, 150]
    rows = []
    for i, length in enumerate(lens):
        blocks = [-1] * 19
        owned = prefix if i >= 37 else []
        for b in range((length + block_size - 1) // block_size):
            blocks[b] = owned[b] if b < len(owned) else pool.pop()
        rows.append(blocks)
    tables = torch.tensor(rows)  # [40, 19]
    generator = torch.Generator().manual_seed(12)
    kv_cache = torch.randn(2, 1200, block_size, kv_heads, head_dim, generator=generator).bfloat16()
    query = torch.randn(len(lens), heads, head_dim, generator=generator).bfloat16()
    seq_lens = torch.tensor(lens)

    def call(selected: list[int], threads: int) -> torch.Tensor:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return cpu_kernels.paged_attention_decode(
                query[selected], kv_cache[0], kv_cache[1], tables[selected], seq_lens[selected], 0.125, window
            )  # [len(selected), heads, head_dim]
        finally:
            torch.set_num_threads(previous)

    together = call(list(range(len(lens))), threads=2)
    for s, length in enumerate(lens):
        assert torch.equal(call([s], threads=1), together[s : s + 1]), f"sequence {s} differs in the batch"
        if length == 0:
            assert not together[s].any()
            continue
        first = max(0, length - window) if window else 0
        expected = expected_decode(query[s], kv_cache, tables[s], length, 0.125, first)  # [heads, head_dim]
        torch.testing.assert_close(together[s].float(), expected, atol=ATOL[torch.bfloat16], rtol=0)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_float32_rows_over_a_16_bit_cache_get_what_a_float32_cache_of_its_values_gives(
    cache_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float32 model with a 16-bit cache (``--kv-cache-dtype``): the new keys and values are stored
    rounded as ``.to()`` rounds them, and decodes, a shared-prefix group and prompt chunks over a
    cached prefix (the prefill kernel where the CPU has it for float32) attend through the kernels,
    bitwise as over a float32 cache holding the same values, and within float32 precision of the
    reference over the 16-bit cache."""
    kernels: list[str] = []
    real_prefill, real_decode = cpu_paged.paged_prefill_attention, cpu_paged.paged_attention_decode
    monkeypatch.setattr(
        cpu_paged, "paged_prefill_attention", lambda *a: kernels.append("prefill") or real_prefill(*a)
    )
    monkeypatch.setattr(
        cpu_paged, "paged_attention_decode", lambda *a: kernels.append("decode") or real_decode(*a)
    )
    query, key, value, kv_cache, metadata = build_step(
        [17, 300, 64], ((1024, 66), (16, 40)), num_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.float32
    )
    narrow = kv_cache.to(cache_dtype)  # [2, num_blocks, block_size, kv_heads, head_dim]
    wide = narrow.float()
    backend = CpuPagedBackend(9, 3, 64, 0.125)
    actual = backend.forward(query, key, value, narrow, metadata)  # [T, heads, head_dim] float32
    kernel_calls = list(kernels)
    same_values = backend.forward(
        query, key.to(cache_dtype).float(), value.to(cache_dtype).float(), wide, metadata
    )
    assert actual.dtype == torch.float32 and torch.equal(actual, same_values)
    assert torch.equal(narrow.float(), wide)
    slots = metadata.slot_mapping
    assert torch.equal(narrow[0].flatten(0, 1)[slots], key.to(cache_dtype))
    assert torch.equal(narrow[1].flatten(0, 1)[slots], value.to(cache_dtype))
    taken = cpu_kernels.prefill_kernel_available(torch.float32)
    assert kernel_calls == (["decode", "prefill", "prefill"] if taken else ["decode"])
    reference_cache = kv_cache.to(cache_dtype)
    expected = TorchReferenceBackend(9, 3, 64, 0.125).forward(query, key, value, reference_cache, metadata)
    assert torch.equal(reference_cache, narrow)
    torch.testing.assert_close(actual, expected, atol=ATOL[torch.float32], rtol=0)

    query, grouped_cache, tables, lens = shared_prefix_step(torch.float32)
    narrow = grouped_cache.to(cache_dtype)
    grouped = cpu_kernels.paged_attention_decode(query, narrow[0], narrow[1], tables, lens, 0.125)
    assert torch.equal(
        grouped,
        cpu_kernels.paged_attention_decode(query, narrow[0].float(), narrow[1].float(), tables, lens, 0.125),
    )


def test_float32_rows_round_into_a_16_bit_cache_as_to_rounds_them() -> None:
    """write_kv narrows float32 rows to bfloat16 and float16 with ``.to()``'s rounding (ties to even,
    overflow to infinity, NaN kept); the other mixes are refused with the dtypes named."""
    tie = 1.0 + 2.0**-8  # halfway between two bfloat16 values
    special = torch.tensor([tie, -tie, 1e-40, 65520.0, 3.0e38, float("inf"), float("nan"), -0.0])
    rows = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(2))  # [T, kv_heads, head_dim]
    rows[0, 0, :8] = special
    slots = torch.tensor([11, 0, 7, 3, 12])
    for cache_dtype in (torch.bfloat16, torch.float16):
        cache = torch.zeros(2, 4, 4, 2, 16, dtype=cache_dtype)  # 16 slots
        cpu_kernels.write_kv(rows, rows * 2, cache[0], cache[1], slots)
        for stored, source in ((cache[0], rows), (cache[1], rows * 2)):
            stored_rows, expected = stored.flatten(0, 1)[slots], source.to(cache_dtype)
            assert torch.equal(stored_rows.isnan(), expected.isnan())
            assert torch.equal(
                stored_rows.nan_to_num(nan=7.0, posinf=8.0, neginf=9.0), expected.nan_to_num(7.0, 8.0, 9.0)
            )
        untouched = torch.ones(16, dtype=torch.bool)
        untouched[slots] = False
        assert not cache.flatten(1, 2)[:, untouched].any()
    with pytest.raises(RuntimeError, match="got BFloat16 rows and a Half cache"):
        cache = torch.zeros(2, 4, 4, 2, 16, dtype=torch.float16)
        cpu_kernels.write_kv(rows.bfloat16(), rows.bfloat16(), cache[0], cache[1], slots)
    with pytest.raises(RuntimeError, match="got BFloat16 and Float"):
        cache = torch.zeros(2, 4, 4, 2, 16)
        query = torch.randn(1, 2, 16).bfloat16()
        cpu_kernels.paged_attention_decode(
            query, cache[0], cache[1], torch.zeros(1, 1), torch.tensor([3]), 1.0
        )


def test_the_loaded_kernel_is_the_cached_build() -> None:
    """The cache key still names the folder the loaded library came from (it once changed after the
    build, because cpp_extension appends to the flag lists it is given)."""
    assert (cpu_kernels.build_directory() / f"{cpu_kernels.NAME}.so").exists()


def test_write_kv_rejects_a_slot_outside_the_cache() -> None:
    cache = torch.zeros(3, 4, 2, 16)  # 12 slots
    rows = torch.randn(2, 2, 16)
    with pytest.raises(RuntimeError, match="slot 12 outside the cache's 12"):
        cpu_kernels.write_kv(rows, rows, cache, cache.clone(), torch.tensor([0, 12]))
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_kernels.write_kv(rows.bfloat16(), rows.bfloat16(), cache, cache.clone(), torch.tensor([0, 1]))


def test_kernel_rejects_bad_inputs() -> None:
    query = torch.randn(2, 4, 16)
    cache = torch.randn(3, 4, 2, 16)
    tables = torch.zeros(2, 1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        cpu_kernels.paged_attention_decode(query, cache, cache, tables, torch.tensor([3, 5]), 1.0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_kernels.paged_attention_decode(query, cache.bfloat16(), cache, tables, torch.tensor([3, 4]), 1.0)


# ---------------------------------------------------------------- backend selection


def test_selection_defaults_to_the_kernel_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENMILL_ATTENTION_BACKEND", raising=False)
    assert select_backend(torch.device("cpu"), torch.bfloat16) is CpuPagedBackend
    assert select_backend(torch.device("cuda"), torch.bfloat16) is TorchReferenceBackend
    monkeypatch.setenv("TOKENMILL_ATTENTION_BACKEND", "torch")
    assert select_backend(torch.device("cpu"), torch.bfloat16) is TorchReferenceBackend
    monkeypatch.setenv("TOKENMILL_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="TOKENMILL_ATTENTION_BACKEND"):
        select_backend(torch.device("cpu"), torch.bfloat16)


def test_a_kernel_that_cannot_build_is_announced(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_kernels, "load_error", lambda: "CalledProcessError: no compiler")
    monkeypatch.delenv("TOKENMILL_ATTENTION_BACKEND", raising=False)
    with caplog.at_level(logging.WARNING):
        assert select_backend(torch.device("cpu"), torch.float32) is TorchReferenceBackend
    assert "no compiler" in caplog.text and "falling back" in caplog.text
    attention._select.cache_clear()
    monkeypatch.setenv("TOKENMILL_ATTENTION_BACKEND", "cpu")
    with pytest.raises(RuntimeError, match="no compiler"):
        select_backend(torch.device("cpu"), torch.float32)


# ---------------------------------------------------------------- end to end


def test_llm_greedy_tokens_are_the_same_with_both_backends(tiny_model, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model = tiny_model("llama")
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 160) for _ in range(n)] for n in (2, 7, 13, 26)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    tokens = {}
    for backend, cls in (("torch", TorchReferenceBackend), ("cpu", CpuPagedBackend)):
        monkeypatch.setenv("TOKENMILL_ATTENTION_BACKEND", backend)
        attention._select.cache_clear()
        llm = LLM(model.path, dtype="float32", block_size=4, num_blocks=64)
        layer = llm.engine.executor.runner.model.layers[0]
        assert type(layer.self_attn.attn) is cls
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[backend] = [o.outputs[0].token_ids for o in outputs]
    assert tokens["cpu"] == tokens["torch"]
    assert tokens["cpu"] == [model.greedy(p, 20) for p in prompts]


def test_a_16_bit_cache_under_float32_holds_twice_the_tokens_and_keeps_the_tokens(  # type: ignore[no-untyped-def]
    tiny_model, monkeypatch, caplog
) -> None:
    """``kv_cache_dtype="bfloat16"`` under a float32 model: the cache tensors are bfloat16, a byte
    budget holds twice the blocks of a float32 cache, and greedy tokens are the same through the
    kernels as through the reference over the same 16-bit cache; ``--kv-cache-dtype`` reaches it, and
    an unknown type is refused with the choices named. A mix the kernels do not take is announced."""
    model = tiny_model("llama")
    rng = random.Random(6)
    prompts = [[rng.randrange(5, 160) for _ in range(n)] for n in (2, 9, 40, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens, blocks = {}, {}
    for backend, cache_dtype in (("torch", "bfloat16"), ("cpu", "bfloat16"), ("cpu", "float32")):
        monkeypatch.setenv("TOKENMILL_ATTENTION_BACKEND", backend)
        attention._select.cache_clear()
        llm = LLM(
            model.path, dtype="float32", block_size=4, kv_cache_memory=1 << 20, kv_cache_dtype=cache_dtype
        )
        runner = llm.engine.executor.runner
        assert all(cache.dtype == getattr(torch, cache_dtype) for cache in runner.kv_caches)
        blocks[cache_dtype] = runner.num_blocks
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[backend, cache_dtype] = [o.outputs[0].token_ids for o in outputs]
    assert tokens["cpu", "bfloat16"] == tokens["torch", "bfloat16"]
    assert tokens["cpu", "float32"] == [model.greedy(p, 24) for p in prompts]
    assert blocks["bfloat16"] == 2 * blocks["float32"]
    with caplog.at_level(logging.WARNING):
        LLM(model.path, dtype="bfloat16", block_size=4, num_blocks=16, kv_cache_dtype="float16")
    assert "a float16 KV cache under bfloat16 activations attends through the torch reference" in caplog.text

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert build_engine_config("m", **engine_kwargs(parser.parse_args([]))).cache.kv_cache_dtype == "auto"
    args = parser.parse_args(["--kv-cache-dtype", "float16"])
    assert build_engine_config("m", **engine_kwargs(args)).cache.kv_cache_dtype == "float16"
    with pytest.raises(
        ValueError, match="kv_cache_dtype must be auto, float32, bfloat16 or float16, got 'fp8'"
    ):
        build_engine_config("m", kv_cache_dtype="fp8").validate()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_sequence_attention_of_long_chunks_matches_the_padded_batch(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks that start their sequence (plain causal) and chunks that continue one (masked rows),
    of different lengths in one group: the per-sequence path gives the padded batch's result."""
    query, key, value, kv_cache, metadata = build_step(
        [5, 40],
        ((0, 37), (16, 21), (0, 3), (48, 30)),
        num_heads=6,
        num_kv_heads=2,
        head_dim=64,
        dtype=dtype,
    )
    backend = TorchReferenceBackend(6, 2, 64, 0.125)
    outputs = []
    for threshold in (10**9, 1):  # padded batch, then one call per sequence
        monkeypatch.setattr(torch_ref, "PER_SEQUENCE_MIN_QUERIES", threshold)
        outputs.append(backend.forward(query, key, value, kv_cache.clone(), metadata))
    torch.testing.assert_close(outputs[1].float(), outputs[0].float(), atol=ATOL[dtype], rtol=0)


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_fresh_one_kept(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """torch's build waits while its lock file exists: one left by a process killed mid-build would
    hang every later start. A stale lock goes; a fresh one (a build under way) stays."""
    assert not cpu_kernels.remove_stale_build_lock(tmp_path)  # none there
    lock = tmp_path / "lock"
    lock.touch()
    assert not cpu_kernels.remove_stale_build_lock(tmp_path) and lock.exists()
    old = time.time() - cpu_kernels.STALE_BUILD_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    assert cpu_kernels.remove_stale_build_lock(tmp_path) and not lock.exists()


def test_sources_are_staged_into_the_build_folder_and_left_alone_when_unchanged(tmp_path) -> None:  # type: ignore[no-untyped-def]
    source = tmp_path / "pkg" / "kernel.cpp"
    source.parent.mkdir()
    source.write_text("int f() { return 1; }\n")
    folder = tmp_path / "build"
    (staged,) = cpu_kernels.stage_sources(folder, [source])
    assert staged == str(folder / "src" / "kernel.cpp") and Path(staged).read_text() == source.read_text()
    before = Path(staged).stat().st_mtime_ns
    assert cpu_kernels.stage_sources(folder, [source]) == [staged]
    assert Path(staged).stat().st_mtime_ns == before  # unchanged content: no rebuild
    source.write_text("int f() { return 2; }\n")
    cpu_kernels.stage_sources(folder, [source])
    assert Path(staged).read_text() == "int f() { return 2; }\n"
    assert sorted(p.name for p in (folder / "src").iterdir()) == ["kernel.cpp"]  # no partial files left
