"""A GGUF's Q4_K tensors as exact 4-bit groups with float32 scales (``layers/level_sums.py``), for the
layers that hold them.

The weight loader dequantizes every tensor (``gguf_loader.iter_weights``), and a Q4_K tensor's
values in bfloat16 no longer tell its groups' scales (``d * sc`` needs 17 bits). So once the model is
loaded, :func:`keep_exact_k4` reads the Q4_K tensors again from the memory-mapped file, decodes each
into levels, float32 scales and minimums (the block layout as the ``gguf`` package reads it: float16
``d`` and ``dmin``, 12 bytes of 6-bit sub-block scales and minimums, 128 bytes of levels whose low
nibbles are sub-block ``2 j``'s and high nibbles sub-block ``2 j + 1``'s), and gives the copy to each
linear layer whose bfloat16 weight equals those values rounded (or whose float32 weight equals
them): matched by content, so names, merges and layout fixes need no mapping, and a layer that is
not exactly such a tensor (a merged or re-laid-out one, a weight changed since) is never given one.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K
from torch import nn

from tokenmill.layers.cpu_kernels import load_error
from tokenmill.layers.int4 import blocked_f32_takes, int4_pairs_available
from tokenmill.layers.level_sums import LevelWeight, pack_levels
from tokenmill.layers.linear import LinearBase
from tokenmill.loader.gguf_loader import open_reader

SUPER_BLOCK = 256  # weights per Q4_K block
BLOCK_BYTES = 144  # float16 d and dmin, 12 bytes of scales, 128 of levels
_LevelsAndScales = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def decode_q4_k(blocks: np.ndarray, out_features: int, in_features: int) -> _LevelsAndScales:
    """``(levels [out, in] uint8, scales [out, in / 32] float32, mins [out, in / 32] float32)`` of the
    Q4_K ``blocks`` (uint8, ``out * in / 256`` blocks of 144 bytes, rows of ``in`` weights): a weight is
    ``scale * level + min`` of its group of 32."""
    blocks = blocks.reshape(-1, BLOCK_BYTES)  # [n, 144]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)  # [n, 1]
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [n, 8] each, 0..63
    scales = d * sc.astype(np.float32)  # [n, 8], exact
    mins = -(dmin * m.astype(np.float32))  # [n, 8], exact
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)  # [n, 4 chunks, 1, 32 bytes]
    levels = np.concatenate([qs & 0x0F, qs >> 4], axis=2)  # [n, 4, 2, 32]: sub-blocks 2j, 2j + 1
    groups = in_features // 32
    return (
        torch.from_numpy(np.ascontiguousarray(levels).reshape(out_features, in_features)),
        torch.from_numpy(scales.reshape(out_features, groups)),
        torch.from_numpy(mins.reshape(out_features, groups)),
    )


def _key(shape: tuple[int, ...], first_row: torch.Tensor) -> tuple[tuple[int, ...], bytes]:
    """A weight's shape and its first row's bytes in bfloat16: the index its candidate layers are found by."""
    return tuple(shape), first_row.contiguous().view(torch.int16).numpy().tobytes()


def iter_q4_k(path: str, wanted: set[tuple[tuple[int, ...], bytes]]) -> Iterator[LevelWeight]:
    """The 2-D Q4_K tensors of the GGUF at ``path`` whose first row, rounded to bfloat16, has a key in
    ``wanted`` (only those are decoded whole), as ``LevelWeight`` s."""
    for tensor in open_reader(path).tensors:
        if tensor.tensor_type != GGMLQuantizationType.Q4_K or len(tensor.shape) != 2:
            continue
        in_features, out_features = (int(n) for n in tensor.shape)  # GGUF lists the innermost first
        if in_features % SUPER_BLOCK:
            continue
        raw = np.asarray(tensor.data).reshape(out_features, -1)  # [out, in / 256 * 144]
        first = LevelWeight(*_packed(decode_q4_k(raw[:1], 1, in_features))).dequantize()  # [1, in] float32
        if _key((out_features, in_features), first[0].to(torch.bfloat16)) not in wanted:
            continue
        yield LevelWeight(*_packed(decode_q4_k(raw, out_features, in_features)))


def _packed(decoded: _LevelsAndScales) -> _LevelsAndScales:
    levels, scales, mins = decoded
    return pack_levels(levels), scales, mins


def keep_exact_k4(model: nn.Module, path: str) -> int:
    """Give each bfloat16 or float32 CPU linear layer with no exact copy yet (int4, 8-bit groups, int8)
    the Q4_K tensor of the GGUF at ``path`` whose values it holds exactly, as ``level_weight``; returns
    how many. Bfloat16 layers need the level-sums kernel (AVX512-BF16), float32 ones the blocked kernel
    for float32 rows (AVX2; outputs a multiple of 16); without them nothing changes."""
    if load_error() is not None:
        return 0
    bfloat16 = int4_pairs_available()
    candidates: dict[tuple[tuple[int, ...], bytes], list[LinearBase]] = {}
    for module in model.modules():
        if (
            isinstance(module, LinearBase)
            and (
                (module.weight.dtype == torch.bfloat16 and bfloat16)
                or (module.weight.dtype == torch.float32 and blocked_f32_takes(module.weight.shape[0]))
            )
            and module.weight.device.type == "cpu"
            and module.weight.dim() == 2
            and module.weight.shape[0] > 0
            and module.int4_weight is None
            and module.q8_weight is None
            and module.int8_weight is None
        ):
            weight = module.weight.data
            candidates.setdefault(_key(tuple(weight.shape), weight[0].to(torch.bfloat16)), []).append(module)
    if not candidates:
        return 0
    count = 0
    for k4 in iter_q4_k(path, set(candidates)):
        values = k4.dequantize()  # [out, in] float32
        for module in candidates.get(_key(tuple(values.shape), values[0].to(torch.bfloat16)), []):
            if module.level_weight is None and torch.equal(
                module.weight.data, values.to(module.weight.dtype)
            ):
                module.level_weight = k4
                count += 1
    return count
