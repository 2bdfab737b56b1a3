"""The recurrent layers' C++ CPU kernels (``csrc/recurrent_cpu.cpp`` via ``layers/recurrent_kernel.py``)
against the torch reference (``layers/gated_delta.py``, ``layers/mamba2.py``): odd shapes (columns and
state sizes that are not multiples of 16, more than one column block, prompts crossing the reference's
chunks), the native build and the AVX2 code built beside it, and ``TOKENMILL_RECURRENT_KERNELS=0``
selecting the reference."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers import gated_delta as gd
from tokenmill.layers import mamba2 as m2
from tokenmill.layers import recurrent_kernel as rk

AVX2 = "tokenmill_recurrent_avx2"


@pytest.fixture(params=["native", "avx2"])
def library(request: pytest.FixtureRequest) -> str:
    assert rk.load_error() is None, rk.load_error()
    if request.param == "avx2":
        assert rk.build_variant(AVX2, ("-mno-avx512f",)) is None
        return AVX2
    return rk.LIBRARY


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-5) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def delta_inputs(lead: tuple[int, ...], heads: int, k_dim: int, v_dim: int) -> list[torch.Tensor]:
    q = gd.l2_normalize(torch.randn(*lead, heads, k_dim)) * k_dim**-0.5
    k = gd.l2_normalize(torch.randn(*lead, heads, k_dim))
    v = torch.randn(*lead, heads, v_dim)
    g = -torch.rand(*lead, heads) * 0.5  # log decay
    beta = torch.rand(*lead, heads)
    return [q, k, v, g, beta]


@pytest.mark.parametrize(
    ("n", "heads", "k_dim", "v_dim"), [(1, 1, 16, 16), (37, 3, 20, 70), (130, 2, 32, 129)]
)
def test_gated_delta_prefill_matches_the_chunked_reference(
    library: str, n: int, heads: int, k_dim: int, v_dim: int
) -> None:
    torch.manual_seed(n)
    inputs = delta_inputs((n,), heads, k_dim, v_dim)
    state = torch.randn(heads, k_dim, v_dim)
    before = state.clone()
    ref_out, ref_state = gd.chunked_gated_delta(*inputs, state)
    out, new_state = rk.chunked_gated_delta(*inputs, state, library=library)
    close(out, ref_out)
    close(new_state, ref_state)
    assert torch.equal(state, before)  # the caller's state is not written


@pytest.mark.parametrize(("batch", "heads", "k_dim", "v_dim"), [(1, 2, 16, 16), (5, 3, 24, 65)])
def test_gated_delta_step_matches_the_reference(
    library: str, batch: int, heads: int, k_dim: int, v_dim: int
) -> None:
    torch.manual_seed(batch)
    inputs = delta_inputs((batch,), heads, k_dim, v_dim)
    state = torch.randn(batch, heads, k_dim, v_dim)
    ref_out, ref_state = gd.gated_delta_step(*inputs, state)
    out, new_state = rk.gated_delta_step(*inputs, state, library=library)
    close(out, ref_out)
    close(new_state, ref_state)


@pytest.mark.parametrize(
    ("n", "heads", "head_dim", "state_size"), [(1, 1, 4, 16), (29, 3, 12, 33), (70, 2, 9, 128)]
)
def test_ssd_prefill_matches_the_chunked_reference(
    library: str, n: int, heads: int, head_dim: int, state_size: int
) -> None:
    torch.manual_seed(n)
    x, b, c = (
        torch.randn(n, heads, head_dim),
        torch.randn(n, heads, state_size),
        torch.randn(n, heads, state_size),
    )
    dt, a = torch.rand(n, heads) * 0.3, -torch.rand(heads) - 0.1
    state = torch.randn(heads, head_dim, state_size)
    ref_y, ref_state = m2.chunked_scan(x, dt, a, b, c, state, 8)
    y, new_state = rk.chunked_scan(x, dt, a, b, c, state, 8, library=library)
    close(y, ref_y, 5e-5)
    close(new_state, ref_state)


def test_ssd_step_matches_the_reference(library: str) -> None:
    torch.manual_seed(3)
    batch, heads, head_dim, state_size = 4, 3, 10, 70
    x, b, c = (torch.randn(batch, heads, d) for d in (head_dim, state_size, state_size))
    dt, a = torch.rand(batch, heads), -torch.rand(heads)
    state = torch.randn(batch, heads, head_dim, state_size)
    ref_y, ref_state = m2.scan_step(x, dt, a, b, c, state)
    y, new_state = rk.scan_step(x, dt, a, b, c, state, library=library)
    close(y, ref_y)
    close(new_state, ref_state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_causal_conv_matches_the_reference(library: str, dtype: torch.dtype, with_bias: bool) -> None:
    torch.manual_seed(1)
    n, channels, kernel = 23, 37, 4
    inputs = torch.randn(n, channels).to(dtype)
    state = torch.randn(channels, kernel - 1).to(dtype)
    weight = torch.randn(channels, kernel).to(dtype)
    bias = torch.randn(channels).to(dtype) if with_bias else None
    ends = [5, 16, n]
    ref_out, ref_states = gd.causal_conv(inputs, state, weight, ends, bias)
    out, states = rk.causal_conv(inputs, state, weight, ends, bias, library=library)
    close(out, ref_out, 2e-5 if dtype == torch.float32 else 1e-2)
    assert len(states) == len(ref_states)
    for got, want in zip(states, ref_states):
        assert torch.equal(got, want)
    step_inputs = torch.randn(3, channels).to(dtype)
    step_states = torch.randn(3, channels, kernel - 1).to(dtype)
    ref_step, ref_new = gd.causal_conv_step(step_inputs, step_states, weight, bias)
    step, new = rk.causal_conv_step(step_inputs, step_states, weight, bias, library=library)
    close(step, ref_step, 2e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(new, ref_new)


def test_the_switch_selects_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(2, 3, 4)
    assert rk.applies_to(x)
    assert not rk.applies_to(x.half())
    monkeypatch.setenv("TOKENMILL_RECURRENT_KERNELS", "0")
    assert not rk.applies_to(x)
    monkeypatch.setenv("TOKENMILL_RECURRENT_KERNELS", "yes")
    with pytest.raises(ValueError, match="TOKENMILL_RECURRENT_KERNELS must be 0 or 1"):
        rk.applies_to(x)
