"""Batch invariance for the deterministic mode: a row's result must not depend on the other rows.

Matrix products are where a batch usually leaks into a row: a math library picks its kernel, its
blocking and sometimes a split of the reduction by the number of rows (oneDNN's float32 product of
one row takes a different kernel from that of sixteen, with other rounding). Here every product of
the deterministic mode runs on a multiple of ``ROW_TILE`` rows, zero rows padding the last tile, so
the library always sees the same row counts modulo the tile and each row's reduction order is fixed
(``tests/unit/test_batch_invariant.py`` checks it on the machine it runs on, shape by shape, for the
weight dtypes the mode accepts). The quantized small-batch kernels (int8, int4, exact 8-bit heads),
which are chosen by batch size, are not used: a quantized layer's float weight holds the quantized
values, so the mode computes with the same weights, through the float product.

Attention goes through ``DeterministicBackend`` (every row a decode of its own, a fixed reduction
order per position) and the fused decode stack is dropped (decode-only steps would otherwise take
other kernels than mixed ones).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ROW_TILE = 16


def row_tiled(matmul: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int) -> torch.Tensor:
    """``matmul(x)`` computed on ``x``'s rows padded with zero rows to a multiple of ``tile`` (at
    least one tile); ``x`` is ``[..., in_features]``, the result ``[..., out_features]``."""
    rows = x.reshape(-1, x.shape[-1])  # [num_rows, in_features]
    num_rows = rows.shape[0]
    padding = -num_rows % tile if num_rows else tile
    if padding:
        rows = F.pad(rows, (0, 0, 0, padding))  # [multiple of tile, in_features]
    out = matmul(rows)[:num_rows]  # [num_rows, out_features]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def make_batch_invariant(model: torch.nn.Module) -> None:
    """Put every layer of ``model`` on its batch-invariant path: products in row tiles (layers with a
    ``row_tile`` attribute), attention through ``DeterministicBackend``, no fused decode stack. Run
    after the layers derive their weights (at load and after each weight update)."""
    from tokenmill.layers.attention.backend import AttentionBackend
    from tokenmill.layers.attention.deterministic import DeterministicBackend

    for module in model.modules():
        if hasattr(module, "row_tile"):
            setattr(module, "row_tile", ROW_TILE)  # noqa: B010 - LinearBase, LMHead, FusedExperts
        for name, child in list(vars(module).items()):
            if isinstance(child, AttentionBackend) and not isinstance(child, DeterministicBackend):
                setattr(
                    module,
                    name,
                    DeterministicBackend(child.num_heads, child.num_kv_heads, child.head_dim, child.scale),
                )
    if getattr(model, "decode_stack", None) is not None:
        setattr(model, "decode_stack", None)  # noqa: B010 - only the Llama family has one
