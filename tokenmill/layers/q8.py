"""8-bit groups (GGUF Q8_0's format) for weights that hold exactly such values: the bundled SmolLM2's
tied embedding and LM head.

Format: a weight ``[out, in]`` in groups of 32 consecutive input features, per group a float16 scale
``d`` (tensor ``[out, in / 32]``) and int8 ``q`` (tensor ``[out, in]``); element value
``round_bf16(float(d) * q)`` (the product is exact in float32). A Q8_0 GGUF tensor loaded in bfloat16
holds exactly these values, so a layer whose weight passes :func:`exact_q8_groups` can stream half
the bytes of bfloat16 for the same weight values: not a quantization. In float32 the values are
``float(d) * q`` unrounded (a Q8_0 tensor loaded in float32), for float32 rows: a copy of the groups
in blocks of 16 outputs (:func:`block_q8_layout`, ``csrc/q8_blocked_f32_cpu.cpp``, where the outputs
are a multiple of 16), else ``csrc/group_gemm_f32_cpu.cpp``. Our bfloat16 kernel
(``csrc/q8_gemm_cpu.cpp``, the row kernel of ``csrc/group_gemm.h``) decodes each group once per call
and multiplies it with every input row (bfloat16 dot products, float32 accumulation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tokenmill.layers.cpu_kernels import load_error
from tokenmill.layers.int4 import BLOCK_OUTPUTS, blocked_f32_takes, float32_max_rows

GROUP_SIZE = 32
# Up to this many rows the kernel beats oneDNN's bfloat16 GEMM on the same values, or matches it: on
# SmolLM2's LM head (49152 x 576, 2 threads, Zen 4 with AVX512-BF16, medians of 30-60 calls) 0.89 vs
# 1.39 ms at one row, 1.04 vs 1.44 at two, 1.18 vs 1.47 at three, 1.31-1.37 vs 1.55-1.76 at four,
# 1.50-1.62 vs 1.12-1.89 at five (ahead in three runs of four); from six oneDNN is as fast or faster
# (1.77-1.80 vs 1.59-1.82, 2.1 vs 1.9 at eight). Larger steps use the bfloat16 weight. Five rows is
# a speculative step verifying 4 drafts (the default): its rows then take the kernel a one-row
# decode takes, whose bits do not depend on the step's rows.
Q8_MAX_ROWS = 5
# float32 rows: the same bound as int4's on float32 rows (layers/int4.py INT4_FLOAT32_MAX_ROWS, measured
# on the projections and this head together).
Q8_FLOAT32_MAX_ROWS = 3
# float32 rows on the blocked copy (csrc/q8_blocked_f32_cpu.cpp) take the int4 blocked kernel's bounds
# by vector width (layers/int4.py INT4_BLOCKED_F32_MAX_ROWS): on SmolLM2's head (49152 x 576, 2-core
# Zen 5) even the row kernel beat the float32 weight at every row count to 8 (2.39 against 2.77 ms at 8).


def block_q8_layout(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [out / 16, G, 512] int8, scales [out / 16, G, 16] float16)``: per block of 16 outputs and
    group, 32 rows of 16 bytes, row ``j`` the 16 outputs' levels of feature ``j`` (the layout of
    ``csrc/q8_blocked_f32_cpu.cpp``). ValueError unless ``out`` is a multiple of 16."""
    out_features, in_features = q.shape
    if out_features % BLOCK_OUTPUTS:
        raise ValueError(
            f"the blocked q8 layout needs out_features a multiple of {BLOCK_OUTPUTS}, got {out_features}"
        )
    blocks, groups = out_features // BLOCK_OUTPUTS, in_features // GROUP_SIZE
    by_feature = q.reshape(blocks, BLOCK_OUTPUTS, groups, GROUP_SIZE).permute(0, 2, 3, 1)  # [B, G, 32, 16]
    block_scales = scales.reshape(blocks, BLOCK_OUTPUTS, groups).permute(0, 2, 1)  # [B, G, 16]
    return by_feature.reshape(
        blocks, groups, GROUP_SIZE * BLOCK_OUTPUTS
    ).contiguous(), block_scales.contiguous()


def exact_q8_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(q [out, in] int8, scales [out, in / 32] float16)`` whose values equal the bfloat16 ``weight``
    element for element, or None when it has no such form (``in`` not a multiple of 32, or a group
    whose values are not ``round_bf16(d * q)`` for one float16 ``d`` and int8 ``q``). Per group the
    kernel (``csrc/q8_gemm_cpu.cpp``) tries the float16 neighbours of ``max|w| / 127`` (a Q8_0 group's
    largest ``|q|`` is 127, and the bfloat16 value of ``127 d`` hides the last bits of ``d``).
    RuntimeError when the C++ kernels are unavailable."""
    error = load_error()
    if error is not None:
        raise RuntimeError(f"exact 8-bit groups need the C++ CPU kernels, which are unavailable: {error}")
    if weight.dim() != 2 or weight.shape[1] % GROUP_SIZE:
        return None
    if weight.dtype == torch.float32:
        return _exact_float32_groups(weight)
    if weight.dtype != torch.bfloat16:
        return None
    q, scales, found = torch.ops.tokenmill.q8_groups_of(weight.contiguous())
    return (q, scales) if found else None


def _exact_float32_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The exact 8-bit groups of a float32 weight: values ``d * q`` unrounded (a Q8_0 tensor dequantized
    in float32). A Q8_0 group's largest ``|q|`` is 127, so ``d = max|w| / 127`` exactly."""
    out_features = weight.shape[0]
    groups = weight.reshape(out_features, -1, GROUP_SIZE)  # [out, G, 32]
    scales = (groups.abs().amax(dim=2) / 127.0).to(torch.float16)  # [out, G]
    d = scales.float()[..., None]  # [out, G, 1]
    q = torch.where(d > 0, torch.round(groups / torch.where(d > 0, d, 1.0)), 0.0).clamp(-127, 127)
    if not torch.equal(q * d, groups):
        return None
    return q.to(torch.int8).reshape(out_features, -1), scales


def dequantize_q8_reference(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The bfloat16 weight ``[out, in]`` of ``(q, scales)`` from torch ops (the format's definition)."""
    out_features = q.shape[0]
    groups = q.reshape(out_features, -1, GROUP_SIZE).float()  # [out, G, 32]
    return (groups * scales.float()[..., None]).to(torch.bfloat16).reshape(out_features, -1)


@dataclass
class Q8Weight:
    """A weight's exact 8-bit groups (see the module docstring) for steps of 1 to ``max_rows`` rows."""

    q: torch.Tensor  # [out_features, in_features] int8
    scales: torch.Tensor  # [out_features, in_features / 32] float16
    max_rows: int = Q8_MAX_ROWS
    # The most float32 rows a step takes the kernels for: the blocked copy's bound where it serves,
    # else Q8_FLOAT32_MAX_ROWS (set in __post_init__).
    float32_max_rows: int = 0
    _blocked: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.float32_max_rows <= 0:
            self.float32_max_rows = float32_max_rows(self.q.shape[0], Q8_FLOAT32_MAX_ROWS)

    def blocked_f32(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(q, scales)`` in the blocked layout for float32 steps where its kernel runs and the
        outputs are a multiple of 16 (made on first use), else None."""
        if not blocked_f32_takes(self.q.shape[0]):
            return None
        if self._blocked is None:
            self._blocked = block_q8_layout(self.q, self.scales)
        return self._blocked

    def pair(self, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensors ``q8_linear`` multiplies a step of ``rows`` rows of ``dtype`` with: the blocked
        copy for the float32 steps it takes, else the row layout."""
        if (
            dtype == torch.float32
            and rows <= self.float32_max_rows
            and (blocked := self.blocked_f32()) is not None
        ):
            return blocked
        return self.q, self.scales

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through the kernels: 2-D bfloat16 with 1 to ``max_rows`` rows, or float32
        with 1 to ``float32_max_rows``."""
        if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32):
            return False
        return 0 < x.shape[0] <= (self.max_rows if x.dtype == torch.bfloat16 else self.float32_max_rows)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` ``[rows, out_features]`` in x's dtype (float32 accumulation)."""
        return torch.ops.tokenmill.q8_linear(x, *self.pair(x.shape[0], x.dtype))  # [rows, out_features]


def exact_q8_weight(
    weight: torch.Tensor,
    find_groups: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None] = exact_q8_groups,
) -> Q8Weight | None:
    """A :class:`Q8Weight` holding exactly ``weight``'s values as ``find_groups`` finds them
    (:func:`exact_q8_groups`, or :func:`exact_small_level_groups`), or None when it has no such form,
    is not on the CPU or the C++ kernels are unavailable (then nothing changes: this is not an opt-in
    mode)."""
    if weight.device.type != "cpu" or load_error() is not None:
        return None
    groups = find_groups(weight)
    return None if groups is None else Q8Weight(*groups)


# The largest |q| of a group by GGUF format: Q8_0's 127, and Q5_0's 16 (its group's largest value is
# ``-16 d`` exactly: levels ``(q - 16) d`` with ``d = max / -16``).
_LARGEST_LEVELS = (127, 16)
# float16 neighbours of ``max|w| / largest`` tried as the scale (bfloat16 hides d's last 3 bits).
_SCALE_STEPS = (0, 1, -1, 2, -2, 3, -3, 4, -4, 5, -5, 6, -6, 7, -7, 8, -8)


def exact_small_level_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(q [out, in] int8, scales [out, in / 32] float16)`` holding exactly ``weight``'s values in
    this module's format, like :func:`exact_q8_groups`, for groups whose levels are any integers up
    to 127 in magnitude: besides Q8_0 tensors, a Q5_0 tensor's groups (levels -16..15), which then
    stream at 8.5 bits per weight instead of bfloat16's 16 (the kernel's values are the weight's:
    not a quantization). Each group's scale is searched among the float16 neighbours of
    ``max|w| / 127`` and ``max|w| / 16``. None when some group has no such form or the layout does
    not fit (``in`` not a multiple of 32, a dtype other than bfloat16 / float32); the first row is
    screened before the whole weight, so a weight of other values costs one row's search."""
    if (
        weight.dim() != 2
        or weight.shape[1] % GROUP_SIZE
        or weight.dtype not in (torch.bfloat16, torch.float32)
    ):
        return None
    if _search_groups(weight[:1]) is None:
        return None
    return _search_groups(weight)


def _search_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    out_features = weight.shape[0]
    groups = weight.reshape(-1, GROUP_SIZE).float()  # [N, 32]
    q = torch.zeros(groups.shape, dtype=torch.int8)  # [N, 32]
    scales = torch.zeros(groups.shape[0], dtype=torch.float16)  # [N]
    amax = groups.abs().amax(dim=1)  # [N]; an all-zero group keeps d = 0, q = 0
    todo = torch.nonzero(amax > 0).flatten()  # [M] groups without a scale yet
    for largest in _LARGEST_LEVELS:
        guess = (amax[todo] / largest).to(torch.float16).view(torch.int16)  # [M]
        for step in _SCALE_STEPS:
            if todo.numel() == 0:
                break
            d = (guess + step).view(torch.float16).float()  # [M]
            usable = torch.isfinite(d) & (d > 0)
            safe = torch.where(usable, d, 1.0)[:, None]  # [M, 1]
            values = groups[todo]  # [M, 32]
            levels = torch.round(values / safe).clamp(-127, 127)  # [M, 32]
            decoded = (levels * safe).to(weight.dtype).float()  # the kernel's value of each level
            fits = usable & (decoded == values).all(dim=1)  # [M]
            found = todo[fits]
            q[found] = levels[fits].to(torch.int8)
            scales[found] = d[fits].to(torch.float16)
            todo, guess = todo[~fits], guess[~fits]
    if todo.numel():
        return None
    return q.reshape(out_features, -1), scales.reshape(out_features, -1)
