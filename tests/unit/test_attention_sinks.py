"""Attention sinks (gpt-oss) through the attention backend interface: the reference computes them as a
per-head logit in each softmax denominator; the CPU backend's decode kernel has them (its prompt
chunks go through the reference's code) and the deterministic backend adds them to its per-row
softmax; both give the reference's answer, never one without the sinks."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_cpu_attention import ATOL, build_step
from tokenmill.layers.attention import cpu_paged
from tokenmill.layers.attention.cpu_paged import CpuPagedBackend
from tokenmill.layers.attention.deterministic import DeterministicBackend
from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.layers.attention.torch_ref import TorchReferenceBackend

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
# Decodes around block boundaries, a chunk over a cached prefix, and a chunk long enough (>= 256 tokens)
# for the reference's one-sequence-at-a-time path.
SEQ_LENS = [1, 16, 17, 40]
CHUNKS = ((5, 9), (0, 300))


def _naive(
    query: torch.Tensor,  # [num_tokens, H, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, D], after the step's K/V are stored
    metadata: AttentionMetadata,
    sinks: torch.Tensor,  # [H]
    window: int | None,
) -> torch.Tensor:
    """Row by row in float64, straight from the definition."""
    out = torch.empty(query.shape, dtype=torch.float64)
    for group in metadata.groups:
        assert group.spans is not None and group.block_tables is not None
        for s, (row, start, num_new) in enumerate(group.spans):
            blocks = group.block_tables[s]
            keys = kv_cache[0, blocks].flatten(0, 1).double()  # [positions, kv_heads, D]
            values = kv_cache[1, blocks].flatten(0, 1).double()
            for i in range(num_new):
                position = start + i
                first = 0 if window is None else max(0, position + 1 - window)
                k = keys[first : position + 1].repeat_interleave(HEADS // KV_HEADS, dim=1)  # [n, H, D]
                v = values[first : position + 1].repeat_interleave(HEADS // KV_HEADS, dim=1)
                scores = (k * query[row + i].double()).sum(-1) * HEAD_DIM**-0.5  # [n, H]
                denominator = torch.exp(scores).sum(0) + torch.exp(sinks.double())  # [H]
                out[row + i] = (torch.exp(scores)[..., None] * v).sum(0) / denominator[:, None]
    return out


@pytest.mark.parametrize("window", [None, 8])
def test_reference_sinks_follow_the_definition_and_matter(window: int | None) -> None:
    query, key, value, kv_cache, metadata = build_step(
        SEQ_LENS,
        CHUNKS,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.float32,
        window=window,
    )
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0])
    reference = TorchReferenceBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    with_sinks = reference.forward(query, key, value, kv_cache, metadata, sinks=sinks)
    expected = _naive(query, kv_cache, metadata, sinks, window)
    assert torch.allclose(with_sinks.double(), expected, atol=1e-5)
    without = reference.forward(query, key, value, kv_cache, metadata)
    assert (without - with_sinks).abs().max() > 0.05  # a sink of logit 4 takes a visible share


@pytest.mark.parametrize("chunks", [CHUNKS, ()], ids=["decodes-and-chunks", "decodes-only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_and_deterministic_backends_give_the_reference_answer(
    dtype: torch.dtype, chunks: tuple[tuple[int, int], ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    query, key, value, kv_cache, metadata = build_step(
        SEQ_LENS, chunks, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype, window=8
    )
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0], dtype=dtype)
    scale = HEAD_DIM**-0.5
    expected = TorchReferenceBackend(HEADS, KV_HEADS, HEAD_DIM, scale).forward(
        query, key, value, kv_cache.clone(), metadata, sinks=sinks
    )
    kernel_sinks: list[torch.Tensor | None] = []
    decode_kernel = cpu_paged.paged_attention_decode

    def recording_kernel(*args, sinks=None, **kwargs):  # type: ignore[no-untyped-def]
        kernel_sinks.append(sinks)
        return decode_kernel(*args, sinks=sinks, **kwargs)

    monkeypatch.setattr(cpu_paged, "paged_attention_decode", recording_kernel)
    cpu_cache = kv_cache.clone()
    cpu = CpuPagedBackend(HEADS, KV_HEADS, HEAD_DIM, scale).forward(
        query, key, value, cpu_cache, metadata, sinks=sinks
    )
    assert len(kernel_sinks) == 1 and kernel_sinks[0] is sinks  # the decode rows took the kernel
    assert torch.allclose(cpu.float(), expected.float(), atol=ATOL[dtype])
    no_sinks = CpuPagedBackend(HEADS, KV_HEADS, HEAD_DIM, scale).forward(
        query, key, value, cpu_cache, metadata
    )
    assert not torch.allclose(no_sinks, cpu, atol=1e-2)
    deterministic = DeterministicBackend(HEADS, KV_HEADS, HEAD_DIM, scale).forward(
        query, key, value, kv_cache.clone(), metadata, sinks=sinks
    )
    assert torch.allclose(
        deterministic.float(), expected.float(), atol=1e-5 if dtype == torch.float32 else 2e-2
    )
