"""RoPE and RMSNorm against transformers' own implementations, in float32 and bf16.

Each case builds a tiny config, runs transformers' rotary embedding one sequence at a time (as its
`[batch, seq]` layout requires, and with a fresh module per sequence because its dynamic NTK state
carries over between calls), and compares with one flattened, mixed batch through ours.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, StableLmConfig
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as HFGemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.stablelm.modeling_stablelm import StableLmRotaryEmbedding

from tokenmill.layers.norm import GemmaRMSNorm, RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding, get_rope, rope_parameters

HEAD_DIM = 16
NUM_HEADS = 4
NUM_KV_HEADS = 2
MAX_POS = 64

# Small thetas put the frequency bands of llama3 and the ramp of yarn inside a 16-dim head.
ROPE_CASES: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 100.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn_no_truncate": {
        "rope_type": "yarn",
        "rope_theta": 100.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "truncate": False,
    },
    "yarn_attention_factor": {
        "rope_type": "yarn",
        "rope_theta": 50.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "attention_factor": 0.8,
        "beta_fast": 8.0,
        "beta_slow": 0.5,
    },
    "yarn_mscale": {
        "rope_type": "yarn",
        "rope_theta": 100.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
    },
    "linear_partial": {
        "rope_type": "linear",
        "rope_theta": 10000.0,
        "factor": 2.0,
        "partial_rotary_factor": 0.5,
    },
    "yarn_partial": {
        "rope_type": "yarn",
        "rope_theta": 100.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "partial_rotary_factor": 0.5,
    },
}

# Two sequences of different lengths: a prefill from 0 and a later chunk of a longer sequence.
MIXED_BATCH = [torch.arange(0, 23), torch.arange(40, 64)]
# Dynamic NTK: one sequence within the original 64 positions, a chunk and a decode token beyond it.
DYNAMIC_BATCH = [torch.arange(0, 40), torch.arange(70, 100), torch.arange(80, 81)]


def llama_config(rope: dict[str, Any], max_position_embeddings: int = MAX_POS) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=HEAD_DIM * NUM_HEADS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=dict(rope),
    )


def hf_reference(
    config: Any,
    rotary_cls: type[torch.nn.Module],
    sequences: list[torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor,
    rotary_dim: int = HEAD_DIM,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rotary embedding run one sequence at a time on the flattened q/k rows."""
    out_q, out_k = [], []
    start = 0
    for positions in sequences:
        rows = slice(start, start + len(positions))
        start += len(positions)
        q = query[rows].transpose(0, 1)[None]  # [1, num_heads, seq, head_dim]
        k = key[rows].transpose(0, 1)[None]  # [1, num_kv_heads, seq, head_dim]
        cos, sin = rotary_cls(config)(q, positions[None])  # fresh module: no dynamic state carried over
        q_rot, k_rot = apply_rotary_pos_emb(q[..., :rotary_dim], k[..., :rotary_dim], cos, sin)
        q = torch.cat([q_rot, q[..., rotary_dim:]], dim=-1)
        k = torch.cat([k_rot, k[..., rotary_dim:]], dim=-1)
        out_q.append(q[0].transpose(0, 1))
        out_k.append(k[0].transpose(0, 1))
    return torch.cat(out_q), torch.cat(out_k)


def random_qk(num_tokens: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=generator)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    return query.to(dtype), key.to(dtype)


def ours(
    rope: RotaryEmbedding,
    sequences: list[torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor,
    pass_seq_lens: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.cat(sequences)
    seq_lens = torch.cat([torch.full_like(p, int(p[-1]) + 1) for p in sequences]) if pass_seq_lens else None
    return rope(positions, query, key, seq_lens=seq_lens)


def assert_matches(
    actual: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype
) -> None:
    for got, want in zip(actual, expected, strict=True):
        assert got.dtype == want.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        else:
            torch.testing.assert_close(got, want, atol=1e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_matches_transformers(case: str, dtype: torch.dtype) -> None:
    params = ROPE_CASES[case]
    config = llama_config(params)
    rope = get_rope(config, HEAD_DIM)
    rotary_dim = int(HEAD_DIM * params.get("partial_rotary_factor", 1.0))
    assert rope.rotary_dim == rotary_dim
    query, key = random_qk(sum(len(p) for p in MIXED_BATCH), dtype)
    expected = hf_reference(config, LlamaRotaryEmbedding, MIXED_BATCH, query, key, rotary_dim)
    assert_matches(ours(rope, MIXED_BATCH, query, key), expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_default_matches_stablelm(dtype: torch.dtype) -> None:
    # LlamaRotaryEmbedding ignores partial_rotary_factor for the default type; StableLM honours it.
    config = StableLmConfig(
        hidden_size=HEAD_DIM * NUM_HEADS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POS,
        partial_rotary_factor=0.25,
    )
    rope = get_rope(config, HEAD_DIM)
    assert rope.rotary_dim == 4
    query, key = random_qk(sum(len(p) for p in MIXED_BATCH), dtype)
    expected = hf_reference(config, StableLmRotaryEmbedding, MIXED_BATCH, query, key, rotary_dim=4)
    assert_matches(ours(rope, MIXED_BATCH, query, key), expected, dtype)
    # The dims past rotary_dim pass through untouched.
    got_q, _ = ours(rope, MIXED_BATCH, query, key)
    assert torch.equal(got_q[..., 4:], query[..., 4:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dynamic_ntk_uses_each_sequences_length(dtype: torch.dtype) -> None:
    config = llama_config({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    rope = get_rope(config, HEAD_DIM, max_position=128)
    query, key = random_qk(sum(len(p) for p in DYNAMIC_BATCH), dtype)
    expected = hf_reference(config, LlamaRotaryEmbedding, DYNAMIC_BATCH, query, key)
    assert_matches(ours(rope, DYNAMIC_BATCH, query, key), expected, dtype)


@pytest.mark.parametrize(
    ("factor", "sequences"),
    [
        (3.0, [torch.arange(0, 150)]),
        (1.7, [torch.arange(0, 1000), torch.arange(2000, 2049), torch.arange(30, 31)]),
    ],
)
def test_dynamic_ntk_positions_beyond_cache(factor: float, sequences: list[torch.Tensor]) -> None:
    # The cache only covers the original 64 positions; longer sequences are computed on the fly, and
    # their frequencies must round exactly as transformers' do, or the error grows with the position.
    config = llama_config({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": factor})
    rope = get_rope(config, HEAD_DIM)
    assert rope.max_position == MAX_POS
    query, key = random_qk(sum(len(p) for p in sequences), torch.float32)
    expected = hf_reference(config, LlamaRotaryEmbedding, sequences, query, key)
    assert_matches(ours(rope, sequences, query, key), expected, torch.float32)


def test_dynamic_ntk_default_seq_lens_is_whole_batch() -> None:
    # Without seq_lens the batch counts as one sequence of length max(positions) + 1, like transformers.
    config = llama_config({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 3.0})
    rope = get_rope(config, HEAD_DIM)
    sequence = [torch.arange(0, 150)]
    query, key = random_qk(150, torch.float32)
    expected = hf_reference(config, LlamaRotaryEmbedding, sequence, query, key)
    assert_matches(ours(rope, sequence, query, key, pass_seq_lens=False), expected, torch.float32)


def test_dynamic_ntk_short_sequences_are_unscaled() -> None:
    config = llama_config({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    plain = get_rope(llama_config({"rope_type": "default", "rope_theta": 10000.0}), HEAD_DIM)
    rope = get_rope(config, HEAD_DIM)
    query, key = random_qk(len(MIXED_BATCH[0]) + len(MIXED_BATCH[1]), torch.float32)
    # Clones: on the fused CPU path the rotation happens in place.
    expected = ours(plain, MIXED_BATCH, query.clone(), key.clone())
    for got, want in zip(ours(rope, MIXED_BATCH, query.clone(), key.clone()), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_legacy_rope_scaling_config_matches_rope_parameters() -> None:
    legacy = types.SimpleNamespace(
        max_position_embeddings=MAX_POS,
        rope_theta=100.0,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    )
    params = rope_parameters(legacy)  # type: ignore[arg-type]
    assert params["rope_type"] == "yarn" and params["rope_theta"] == 100.0
    assert "type" not in params
    modern = get_rope(llama_config(ROPE_CASES["yarn"]), HEAD_DIM)
    old = get_rope(legacy, HEAD_DIM)  # type: ignore[arg-type]
    assert old.attention_scaling == modern.attention_scaling
    assert torch.equal(old.cos_cache, modern.cos_cache) and torch.equal(old.sin_cache, modern.sin_cache)
    # No rope dict at all: default rope with the top-level theta.
    bare = types.SimpleNamespace(max_position_embeddings=MAX_POS, rope_theta=10000.0, rope_scaling=None)
    assert rope_parameters(bare)["rope_type"] == "default"  # type: ignore[arg-type]


def test_nested_rope_parameters_need_layer_type() -> None:
    config = types.SimpleNamespace(
        max_position_embeddings=MAX_POS,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
    )
    with pytest.raises(ValueError, match="layer_type"):
        get_rope(config, HEAD_DIM)  # type: ignore[arg-type]
    assert get_rope(config, HEAD_DIM, layer_type="sliding_attention").attention_scaling == 1.0  # type: ignore[arg-type]
    assert rope_parameters(config, "full_attention")["factor"] == 2.0  # type: ignore[arg-type]


@pytest.mark.parametrize("rope_type", ["longrope", "mrope", "su"])
def test_unknown_rope_type_raises(rope_type: str) -> None:
    config = types.SimpleNamespace(
        max_position_embeddings=MAX_POS, rope_parameters={"rope_type": rope_type, "rope_theta": 1e4}
    )
    with pytest.raises(ValueError, match=rope_type):
        get_rope(config, HEAD_DIM)  # type: ignore[arg-type]


def test_flat_heads_layout_and_empty_batch() -> None:
    rope = get_rope(llama_config(ROPE_CASES["llama3"]), HEAD_DIM)
    positions = torch.tensor([5, 0, 63])
    query, key = random_qk(3, torch.float32)
    q3, k3 = rope(positions, query.clone(), key.clone())  # clones: the fused CPU path works in place
    q2, k2 = rope(positions, query.flatten(1).clone(), key.flatten(1).clone())
    assert q2.shape == (3, NUM_HEADS * HEAD_DIM)
    assert torch.equal(q2.view_as(q3), q3) and torch.equal(k2.view_as(k3), k3)
    empty_q, empty_k = rope(positions[:0], query[:0], key[:0])
    assert empty_q.shape == (0, NUM_HEADS, HEAD_DIM) and empty_k.shape == (0, NUM_KV_HEADS, HEAD_DIM)


def test_caches_stay_float32_and_out_of_state_dict() -> None:
    rope = get_rope(llama_config(ROPE_CASES["yarn"]), HEAD_DIM).to(torch.bfloat16)
    assert rope.cos_cache.dtype == torch.float32 and rope.sin_cache.dtype == torch.float32
    assert not rope.state_dict()
    assert not list(rope.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_llama(dtype: torch.dtype) -> None:
    hidden = 32
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(hidden, generator=generator).to(dtype)
    x = (3 * torch.randn(7, hidden, generator=generator)).to(dtype)
    residual = torch.randn(7, hidden, generator=generator).to(dtype)
    reference = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    norm = RMSNorm(hidden, eps=1e-5).to(dtype)

    def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
        # bfloat16 bit for bit; float32 (the fused CPU path sums the squares in its own vector order,
        # which agrees with torch's on some CPUs and not on others) to float32 rounding.
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)

    with torch.no_grad():
        reference.weight.copy_(weight)
        norm.weight.copy_(weight)
        assert_matches(norm(x), reference(x))
        # Clones: the fused CPU path reuses the memory of its inputs.
        normed, new_residual = norm(x.clone(), residual.clone())
        assert new_residual.dtype == dtype
        assert torch.equal(new_residual, residual + x)
        assert_matches(normed, reference(residual + x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_matches_transformers(dtype: torch.dtype) -> None:
    """Plain, residual and per-head (3-D strided view of a fused QKV output) forms, on the fused CPU
    op (csrc/gemma_ops_cpu.cpp) where it is built: bfloat16 bit for bit, float32 to its rounding (the
    squares are summed in the op's vector order)."""
    hidden = 32
    generator = torch.Generator().manual_seed(2)
    weight = (0.1 * torch.randn(hidden, generator=generator)).to(dtype)
    x = torch.randn(5, hidden, generator=generator).to(dtype)
    residual = torch.randn(5, hidden, generator=generator).to(dtype)
    qkv = torch.randn(3, 4 * hidden, generator=generator).to(dtype)  # 3 heads of q, then k
    reference = HFGemmaRMSNorm(hidden, eps=1e-6).to(dtype)
    norm = GemmaRMSNorm(hidden, eps=1e-6).to(dtype)

    def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
        assert got.dtype == dtype and got.shape == want.shape
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)

    with torch.no_grad():
        reference.weight.copy_(weight)
        norm.weight.copy_(weight)
        for prepared in (False, True):
            if prepared:
                norm.prepare_for_inference()  # keeps 1 + weight in float32: the same values
                assert norm.one_plus_weight is not None
            assert_matches(norm(x), reference(x))
            # Clones: the fused CPU path reuses the memory of its inputs.
            normed, new_residual = norm(x.clone(), residual.clone())
            assert torch.equal(new_residual, residual + x)
            assert_matches(normed, reference(residual + x))
            heads = qkv[:, : 3 * hidden].view(3, 3, hidden)  # [tokens, heads, head_dim], rows strided
            assert_matches(norm(heads), reference(heads))
