"""Batch invariance for the deterministic mode: a row's result must not depend on the other rows.

Matrix products are where a batch usually leaks into a row: a math library picks its kernel, its
blocking and sometimes a split of the reduction by the number of rows (oneDNN's float32 product of
one row takes a different kernel from that of sixteen, with other rounding). Where no row kernel
serves (below), every product of the deterministic mode runs on a multiple of ``ROW_TILE`` rows, zero rows padding the last tile, so
the library always sees the same row counts modulo the tile and each row's reduction order is fixed
(``tests/unit/test_batch_invariant.py`` checks it on the machine it runs on, shape by shape, for the
weight dtypes the mode accepts). On that path the quantized small-batch kernels, chosen by batch
size, are not used: a quantized layer's float weight holds the quantized values, so the mode
computes with the same weights, through the float product.

Where the C++ row kernel is built (AVX512-BF16, ``csrc/group_gemm.h``), bfloat16 rows skip the
padding: ``invariant_product`` multiplies them with a kernel whose every output row is one fixed
sequence of dot-product instructions over the input in order, whatever the number of rows or
threads: the int4 row kernel (``int4_linear`` method 1: 1 row and 64 rows give the same bits), the
exact 8-bit groups' kernel (the bundled SmolLM2's head) and, for a plain bfloat16 weight,
``csrc/batch_invariant_gemm_cpu.cpp``. A single stream then multiplies one row, not sixteen, and
quantized layers stream their packed weights. The kernels' rounding differs from oneDNN's, so the
mode's bits differ from the default mode's (as they already did); within the mode every layer takes
one kernel for a dtype, so a row's bits depend only on the row.

All three run ``group_gemm.h``'s loop: per output and row, one float32 accumulator takes the
bfloat16 dot products of the 32-wide groups in input order, then one horizontal sum and a rounding.
The packed formats decode a group to exactly the bfloat16 values of the layer's weight (the int4
kernel's ``round_bf16(fma(q, d, m))`` is ``int4_dequantize``'s, the 8-bit kernel's
``round_bf16(d * q)`` the exact Q8_0 value), so for the same rows the int4 row kernel, the 8-bit
kernel and the bfloat16 kernel over the weight give the same bits (``test_batch_invariant.py``
checks it). ``invariant_product`` therefore streams the packed weight for a few rows (decode, where
bytes bound the time) and multiplies the bfloat16 weight for more (prompts, where decoding groups
would), without a row's bits depending on which.

Attention goes through ``DeterministicBackend`` (every row a decode of its own, a fixed reduction
order per position). The fused decode stack is kept where it can run row-independently (bfloat16
int4 layers on the row kernel: ``FusedDecodeStack.fitted``) and then takes every step, else dropped
(decode-only steps would otherwise take other kernels than mixed ones).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tokenmill.layers.cpu_kernels import load_error

if TYPE_CHECKING:
    from tokenmill.layers.int4 import Int4Weight
    from tokenmill.layers.q8 import Q8Weight

ROW_TILE = 16
GROUP_SIZE = 32  # the row kernel's group of input features (csrc/group_gemm.h kGroup)
ROWS_METHOD = 1  # int4_linear's row kernel (layers/int4.py METHOD_ROWS)
# Up to these many rows the packed formats' row kernels stream fewer bytes; above, the bfloat16 row
# kernel over the layer's weight does less work per row. Both give the same bits (see the docstring).
INT4_ROWS = 8
Q8_ROWS = 1


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


@functools.cache
def row_kernel_available() -> bool:
    """Whether the batch-invariant row kernels are built here (C++ kernels loaded, AVX512-BF16 path)."""
    return load_error() is None and bool(torch.ops.tokenmill.batch_invariant_linear_available())


def invariant_product(
    x: torch.Tensor,  # [..., in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None,  # [out_features]
    float_matmul: Callable[[torch.Tensor], torch.Tensor],
    tile: int,
    int4: Int4Weight | None = None,
    q8: Q8Weight | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` ``[..., out_features]`` with each row's bits independent of the other rows.

    bfloat16 CPU rows go through a row kernel when it is built: ``int4``'s packed weight if given,
    else ``q8``'s exact 8-bit groups, else the bfloat16 ``weight`` (``in_features`` a multiple of 32).
    Anything else (float32 rows, other shapes, no kernel) runs ``float_matmul`` (which adds the bias
    itself) on rows padded to a multiple of ``tile`` (``row_tiled``). ``int4`` serves up to
    ``INT4_ROWS`` rows and ``q8`` up to ``Q8_ROWS``, the bfloat16 kernel more: ``weight`` must hold
    exactly their decoded values (it does: ``LinearBase.quantize_weights``, ``LMHead.keep_exact_q8``),
    and then the kernels give the same bits, so the switch is not a batch dependence."""
    rows = x.reshape(-1, x.shape[-1])  # [num_rows, in_features]
    if rows.dtype != torch.bfloat16 or rows.device.type != "cpu" or not row_kernel_available():
        return row_tiled(float_matmul, x, tile)
    rows = rows.contiguous()
    num_rows = rows.shape[0]
    if int4 is not None and num_rows <= INT4_ROWS:
        out = torch.ops.tokenmill.int4_linear(rows, int4.packed, int4.scales, int4.mins, ROWS_METHOD)
    elif q8 is not None and num_rows <= Q8_ROWS:
        out = torch.ops.tokenmill.q8_linear(rows, q8.q, q8.scales)  # [num_rows, out_features]
    elif weight.dtype == torch.bfloat16 and weight.shape[1] % GROUP_SIZE == 0 and weight.is_contiguous():
        out = torch.ops.tokenmill.batch_invariant_linear(rows, weight)  # [num_rows, out_features]
    else:
        return row_tiled(float_matmul, x, tile)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


def make_batch_invariant(model: torch.nn.Module) -> None:
    """Put every layer of ``model`` on its batch-invariant path: products on row kernels or in row tiles
    (layers with a ``row_tile`` attribute), attention through ``DeterministicBackend`` (latent
    attention through ``DeterministicMLABackend``), the fused
    decode stack row-independent or none. Run
    after the layers derive their weights (at load and after each weight update)."""
    from tokenmill.layers.attention.backend import AttentionBackend
    from tokenmill.layers.attention.deterministic import DeterministicBackend
    from tokenmill.layers.attention.deterministic_mla import DeterministicMLABackend
    from tokenmill.layers.attention.mla import MLAReferenceBackend

    replaced: dict[int, DeterministicBackend] = {}  # id of a replaced backend: its replacement
    for module in model.modules():
        if hasattr(module, "row_tile"):
            setattr(module, "row_tile", ROW_TILE)  # noqa: B010 - LinearBase, LMHead, FusedExperts
        for name, child in list(vars(module).items()):
            if isinstance(child, AttentionBackend) and not isinstance(child, DeterministicBackend):
                backend = DeterministicBackend(
                    child.num_heads, child.num_kv_heads, child.head_dim, child.scale
                )
                replaced[id(child)] = backend
                setattr(module, name, backend)
            elif isinstance(child, MLAReferenceBackend) and not isinstance(child, DeterministicMLABackend):
                setattr(module, name, DeterministicMLABackend.like(child))  # DeepSeek's latent cache
    stack = getattr(model, "decode_stack", None)  # the Llama family and Gemma 3 have one
    if stack is not None:
        # The stack attends through its first layer's backend; on the replacement it runs
        # row-independently, or is dropped where it cannot (fused_decode_stack.FusedDecodeStack.fitted).
        # A stack rebuilt after a weight update already attends through a replacement.
        target = replaced.get(id(stack.backend))
        if target is not None:
            setattr(model, "decode_stack", stack.with_backend(target))  # noqa: B010
        elif not stack.row_independent:
            setattr(model, "decode_stack", None)  # noqa: B010
