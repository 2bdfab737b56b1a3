"""Mamba-2's selective state-space scan (SSD) in plain torch: chunked for prompts, one step for decode.

Per token and head: ``S = exp(dt * A) S + dt * x B^T`` (``S`` is ``[head_dim, state_size]``) and
``y = S C + D x``, with ``dt = softplus(dt_raw + dt_bias)`` clamped to the model's limits and ``B``/``C``
shared by the heads of a group. A prompt chunk goes in blocks of ``chunk`` tokens: inside a block the
outputs are a masked, decayed ``C B^T`` product with the inputs; across blocks the state is carried.
The short convolution before the scan is ``layers/gated_delta.py``'s. Float32 math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def chunked_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan over one sequence's ``n`` new tokens from ``state``, without the ``D`` skip.

    ``x`` ``[n, heads, head_dim]``, ``dt`` ``[n, heads]`` (after softplus and clamping), ``a`` ``[heads]``
    (negative), ``b``/``c`` ``[n, heads, state_size]`` (groups already repeated to heads), ``state``
    ``[heads, head_dim, state_size]``. Returns ``(y [n, heads, head_dim], final state)``, float32.
    """
    n = x.shape[0]
    pad = (-n) % chunk
    xs, bs, cs = (F.pad(t.float().transpose(0, 1), (0, 0, 0, pad)) for t in (x, b, c))  # [heads, n + pad, .]
    dts = F.pad(dt.float().transpose(0, 1), (0, pad))  # [heads, n + pad]: padded tokens change nothing
    heads, length, _ = xs.shape
    blocks = length // chunk
    xs, bs, cs = (t.reshape(heads, blocks, chunk, -1) for t in (xs, bs, cs))  # [heads, blocks, chunk, .]
    dts = dts.reshape(heads, blocks, chunk)
    cum = (dts * a.float()[:, None, None]).cumsum(-1)  # [heads, blocks, chunk]: log decay so far
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=xs.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    x_dt = xs * dts[..., None]  # [heads, blocks, chunk, head_dim]
    within = ((cs @ bs.transpose(-1, -2)) * decay) @ x_dt  # [heads, blocks, chunk, head_dim]
    to_end = (cum[..., -1:] - cum).exp()[..., None]  # [heads, blocks, chunk, 1]
    block_decay = cum[..., -1].exp()  # [heads, blocks]
    y = torch.empty_like(within)
    s = state.float()
    for i in range(blocks):
        from_state = (cs[:, i] @ s.transpose(-1, -2)) * cum[:, i].exp()[..., None]  # [heads, chunk, head_dim]
        y[:, i] = within[:, i] + from_state
        s = s * block_decay[:, i, None, None] + (x_dt[:, i] * to_end[:, i]).transpose(-1, -2) @ bs[:, i]
    return y.reshape(heads, length, -1)[:, :n].transpose(0, 1), s


def scan_step(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: ``x`` ``[batch, heads, head_dim]``, ``dt`` ``[batch, heads]``, ``a``
    ``[heads]``, ``b``/``c`` ``[batch, heads, state_size]``, ``state`` ``[batch, heads, head_dim,
    state_size]``. Returns ``(y [batch, heads, head_dim] without the D skip, new states)``."""
    dt = dt.float()
    s = (
        state * (dt * a.float()).exp()[..., None, None]
        + (x.float() * dt[..., None])[..., None] * b.float()[:, :, None, :]
    )
    y = (s @ c.float()[..., None])[..., 0]  # [batch, heads, head_dim]
    return y, s
