"""Gemma's fused MLP activation (``csrc/gemma_ops_cpu.cpp``) against torch's; its fused RMSNorm is
tested with the other norms in test_rotary.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers import fused_cpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul_matches_torch(dtype: torch.dtype) -> None:
    """Gemma's MLP activation ``gelu_tanh(gate).to(dtype) * up`` as one op: torch's formula in torch's
    order (0.5 g (1 + tanh y)), so it loses the bits torch loses where tanh y is near -1; our tanh is
    within a float32 ulp or two of torch's. Over 8k values bfloat16 results differ from torch's in
    under 1% of elements, by one bfloat16 ulp."""
    if not fused_cpu.applies_to(torch.zeros(1, dtype=dtype)):
        pytest.skip("the C++ CPU kernels are not built here")
    generator = torch.Generator().manual_seed(3)
    gate_up = (3 * torch.randn(4, 2 * 1024, generator=generator)).to(dtype)  # [rows, 2 * size]
    gate, up = gate_up.chunk(2, dim=1)
    want = F.gelu(gate, approximate="tanh") * up  # [rows, size]
    got = fused_cpu.gelu_tanh_and_mul(gate_up)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.bfloat16:
        assert (got != want).float().mean().item() < 0.01
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-6)
    else:
        scale = up.abs() + 1e-3
        assert ((got - want).abs() / scale).max().item() < 1e-5  # an ulp or two of the tanh, times up
    # Far into the negative tail the result is -0 times up, as torch's.
    tail = torch.tensor([[-30.0, -8.0, 30.0, 2.0, 2.0, 2.0]], dtype=dtype)
    assert torch.equal(
        fused_cpu.gelu_tanh_and_mul(tail), F.gelu(tail[:, :3], approximate="tanh") * tail[:, 3:]
    )
