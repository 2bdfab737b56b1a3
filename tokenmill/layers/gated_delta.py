"""Gated DeltaNet's token mixer in plain torch: the short causal convolution and the gated delta rule.

The reference implementation of the linear-attention layers of Qwen3-Next (float32 math, any device).
A sequence's state between steps is two tensors a slot of the state pool holds
(``layers/recurrent_state.py``): the convolution's last ``kernel - 1`` inputs ``[conv_dim, kernel - 1]``
and the delta rule's matrix ``[num_v_heads, k_head_dim, v_head_dim]``. Prefill runs the chunked form
(a triangular solve inside chunks of 64 tokens, a scan across chunks) from the carried state, so a
prompt split over several steps gives the result of one pass; decode runs the one-token recurrence for
every decoding sequence at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the delta rule's query/key normalisation)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(
    inputs: torch.Tensor,
    state: torch.Tensor,
    weight: torch.Tensor,
    ends: list[int],
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Depthwise causal convolution of one sequence's new ``inputs`` ``[n, channels]`` after the
    carried ``state`` ``[channels, kernel - 1]`` (the inputs before them), plus ``bias``, then SiLU.

    ``weight`` is ``[channels, kernel]``. Returns the outputs ``[n, channels]`` (inputs' dtype) and,
    for each offset ``e`` in ``ends`` (1..n), the state after the first ``e`` new inputs
    ``[channels, kernel - 1]``.
    """
    kernel = weight.shape[-1]
    full = torch.cat([state.transpose(0, 1).to(inputs.dtype), inputs], dim=0)  # [kernel - 1 + n, channels]
    windows = full.unfold(0, kernel, 1)  # [n, channels, kernel]
    out = (windows.float() * weight.float()).sum(-1)  # [n, channels]
    if bias is not None:
        out = out + bias.float()
    states = [full[e : e + kernel - 1].transpose(0, 1) for e in ends]  # each [channels, kernel - 1]
    return F.silu(out).to(inputs.dtype), states


def causal_conv_step(
    inputs: torch.Tensor, states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new input per sequence: ``inputs`` ``[batch, channels]``, ``states`` ``[batch, channels,
    kernel - 1]``. Returns SiLU outputs ``[batch, channels]`` and the new states."""
    full = torch.cat([states.to(inputs.dtype), inputs[:, :, None]], dim=-1)  # [batch, channels, kernel]
    out = (full.float() * weight.float()).sum(-1)  # [batch, channels]
    if bias is not None:
        out = out + bias.float()
    return F.silu(out).to(inputs.dtype), full[:, :, 1:]


def chunked_gated_delta(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence's ``n`` new tokens, from ``state``.

    ``query``/``key`` ``[n, heads, k_dim]`` (already L2-normalised, query scaled by ``k_dim ** -0.5``),
    ``value`` ``[n, heads, v_dim]``, ``log_decay``/``beta`` ``[n, heads]``, ``state`` ``[heads, k_dim,
    v_dim]``, all float32. Per token: ``S = exp(g) S``; ``S += k (beta (v - S^T k))^T``; ``o = S^T q``.
    Tokens go in chunks of ``CHUNK``: inside a chunk the updates are solved at once with a unit lower
    triangular system, across chunks the state is carried. Returns ``(outputs [n, heads, v_dim],
    final state [heads, k_dim, v_dim])``.
    """
    n = query.shape[0]
    pad = (-n) % CHUNK
    # [heads, n + pad, dim]: padded tokens have zero keys (they write nothing) and no decay.
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (query, key, value))
    g, b = (F.pad(x.transpose(0, 1), (0, pad)) for x in (log_decay, beta))  # [heads, n + pad]
    heads, length, k_dim = k.shape
    chunks = length // CHUNK
    q, k, v = (x.reshape(heads, chunks, CHUNK, -1) for x in (q, k, v))  # [heads, chunks, CHUNK, dim]
    g, b = (x.reshape(heads, chunks, CHUNK) for x in (g, b))
    cum = g.cumsum(-1)  # [heads, chunks, CHUNK]: log decay from the chunk's start through each token
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(cum_i - cum_j) for j <= i, else 0
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * b[..., None]  # [heads, chunks, CHUNK, k_dim]
    strict = (k_beta @ k.transpose(-1, -2)) * decay  # [heads, chunks, CHUNK, CHUNK]
    system = strict.masked_fill(~causal.tril(-1), 0.0) + torch.eye(CHUNK, device=q.device)
    solved_v = torch.linalg.solve_triangular(system, v * b[..., None], upper=False, unitriangular=True)
    solved_k = torch.linalg.solve_triangular(
        system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True
    )
    within = (q @ k.transpose(-1, -2)) * decay  # [heads, chunks, CHUNK, CHUNK]
    q_decayed = q * cum.exp()[..., None]  # [heads, chunks, CHUNK, k_dim]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]  # [heads, chunks, CHUNK, k_dim]
    chunk_decay = cum[..., -1].exp()  # [heads, chunks]
    out = torch.empty_like(solved_v)  # [heads, chunks, CHUNK, v_dim]
    s = state.float()
    for c in range(chunks):
        corrected = solved_v[:, c] - solved_k[:, c] @ s  # [heads, CHUNK, v_dim]
        out[:, c] = q_decayed[:, c] @ s + within[:, c] @ corrected
        s = s * chunk_decay[:, c, None, None] + k_to_end[:, c].transpose(-1, -2) @ corrected
    out = out.reshape(heads, length, -1)[:, :n].transpose(0, 1)  # [n, heads, v_dim]
    return out, s


def gated_delta_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence of the gated delta rule (decode). ``query``/``key`` ``[batch, heads,
    k_dim]`` (normalised and scaled as for ``chunked_gated_delta``), ``value`` ``[batch, heads, v_dim]``,
    ``log_decay``/``beta`` ``[batch, heads]``, ``state`` ``[batch, heads, k_dim, v_dim]`` float32.
    Returns ``(outputs [batch, heads, v_dim], new states)``."""
    s = state * log_decay.exp()[..., None, None]  # [batch, heads, k_dim, v_dim]
    recalled = (s * key[..., None]).sum(-2)  # [batch, heads, v_dim]
    delta = (value - recalled) * beta[..., None]  # [batch, heads, v_dim]
    s = s + key[..., None] * delta[..., None, :]
    out = (s * query[..., None]).sum(-2)  # [batch, heads, v_dim]
    return out, s
