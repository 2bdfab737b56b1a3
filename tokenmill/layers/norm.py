"""RMS normalisation layers, numerically identical to their transformers counterparts.

Both norms reduce in float32 whatever the activation dtype. They differ in where the weight is applied,
and each follows the model family it serves: Llama-style `RMSNorm` rounds the normalised activations
to the input dtype and then multiplies by the weight; Gemma-style `GemmaRMSNorm` multiplies by
`1 + weight` in float32 and rounds once at the end.

With `residual` given, `forward(x, residual)` first forms `residual + x` in the activation dtype (the
decoder layer's skip connection, as transformers adds it) and normalises that sum, returning
`(normed, new_residual)`. Callers pass the previous sub-layer's output as `x` and the running residual
stream as `residual`; the first layer calls it without a residual and keeps its input as the stream.
"""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from tokenmill.layers import fused_cpu


def _rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / rms(x)` over the last dim, computed and returned in float32."""
    x = x.float()  # [..., hidden_size]
    variance = x.pow(2).mean(-1, keepdim=True)  # [..., 1]
    return x * torch.rsqrt(variance + eps)  # [..., hidden_size]


class RMSNorm(nn.Module):
    """Llama-style RMSNorm: `weight * (x / rms(x)).to(x.dtype)`, the rms taken in float32.

    Matches transformers' `LlamaRMSNorm` bit for bit, including its dtype rule: the result has the dtype
    that `weight * activations` promotes to, so the weight should be in the activation dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise `x` [..., hidden_size]; with `residual` [..., hidden_size], normalise `residual + x`
        and return `(normed, residual + x)`. On the fused CPU path the residual form reuses the memory
        of `x` and `residual`; callers pass tensors they no longer need."""
        if fused_cpu.applies_to(x) and x.dim() == 2 and x.stride(-1) == 1 and self.weight.dtype == x.dtype:
            if residual is None:
                return fused_cpu.rms_norm(x, self.weight, self.eps)
            if residual.dtype == x.dtype and residual.shape == x.shape and residual.stride(-1) == 1:
                return fused_cpu.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        summed = residual + x  # [..., hidden_size]
        return self._norm(summed), summed

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Rounding to the input dtype before the weight multiply is what LlamaRMSNorm does.
        return self.weight * _rms_normalize(x, self.eps).to(x.dtype)  # [..., hidden_size]

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GemmaRMSNorm(nn.Module):
    """Gemma-style RMSNorm: `((x / rms(x)) * (1 + weight)).to(x.dtype)`, all in float32.

    Checkpoints store the weight as an offset from one (initialised to zeros). Matches transformers'
    `GemmaRMSNorm`; the result always has the input's dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps
        # `1 + weight` in float32, kept by prepare_for_inference (a derived weight: the model runner
        # drops and rebuilds it with the others); None: computed per call. The same values either way.
        self.one_plus_weight: torch.Tensor | None = None

    def prepare_for_inference(self) -> None:
        """Keep `1 + weight` in float32 for every call (two element-wise ops fewer per call); redo
        after weight changes."""
        self.one_plus_weight = 1.0 + self.weight.detach().float()  # [hidden_size]

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise `x` [..., hidden_size]; with `residual` [..., hidden_size], normalise `residual + x`
        and return `(normed, residual + x)`. On the fused CPU path (2-D, or 3-D per-head views with
        contiguous features) the residual form reuses the memory of `x` and `residual`; callers pass
        tensors they no longer need."""
        scale = self.one_plus_weight
        if scale is None or scale.device != x.device:
            scale = 1.0 + self.weight.float()  # [hidden_size]
        if fused_cpu.applies_to(x) and x.dim() in (2, 3) and x.stride(-1) == 1:
            if residual is None:
                return fused_cpu.gemma_rms_norm(x, scale, self.eps)
            if (
                x.dim() == 2
                and residual.dtype == x.dtype
                and residual.shape == x.shape
                and residual.stride(-1) == 1
            ):
                return fused_cpu.add_gemma_rms_norm(x, residual, scale, self.eps)
        if residual is None:
            return self._norm(x, scale)
        summed = residual + x  # [..., hidden_size]
        return self._norm(summed, scale), summed

    def _norm(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        # Gemma multiplies in float32 and rounds once (transformers PR 29402), unlike Llama.
        normed = _rms_normalize(x, self.eps) * scale  # [..., hidden_size]
        return normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
