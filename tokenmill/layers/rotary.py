"""Rotary position embeddings (RoPE) for flattened, paged batches.

The tokens of many sequences arrive as one batch of `num_tokens` rows, each carrying its absolute
position, so the rotation is a gather from a cos/sin cache indexed by position rather than a function
of a padded `[batch, seq]` layout.

Numerics follow Hugging Face transformers (the reference every native model is tested against):
frequencies, cos and sin are computed in float32, the scaling type's attention factor is applied to
cos/sin in float32, and only then are cos/sin rounded to the activation dtype; the rotation itself
runs in the activation dtype (bf16 in, bf16 arithmetic), exactly as `apply_rotary_pos_emb` does. The
layout is "rotate_half" (GPT-NeoX, non-interleaved): dimension `i` of the rotated slice pairs with
dimension `i + rotary_dim // 2`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import nn

from tokenmill.layers import fused_cpu

# transformers' RotaryEmbeddingConfigMixin.default_theta, used when a config names no theta at all.
_DEFAULT_THETA = 10000.0


def _rope_exponents(rotary_dim: int, device: torch.device | None = None) -> torch.Tensor:
    """`2i / rotary_dim` for each rotated pair, in float32: the exponent of the base per frequency."""
    return torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim


def _base_inv_freq(theta: float, rotary_dim: int) -> torch.Tensor:
    """Unscaled RoPE frequencies `theta ** (-2i / rotary_dim)`, float32 [rotary_dim // 2]."""
    return 1.0 / (theta ** _rope_exponents(rotary_dim))


@dataclass(frozen=True)
class DynamicNTKScaling:
    """Dynamic NTK-aware scaling: the base grows with the sequence length once it exceeds the original.

    For a sequence of total length `L > original_max_position`, transformers recomputes
    `theta' = theta * (factor * L / original_max_position - (factor - 1)) ** (d / (d - 2))` and rotates
    every token of that forward with `theta'`; at or below the original length the plain frequencies
    are used.
    """

    theta: float
    factor: float
    original_max_position: int
    rotary_dim: int

    def inv_freq(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """Per-token frequencies for sequence lengths `seq_lens` [num_tokens] -> [num_tokens, rotary_dim // 2].

        Computed once per distinct length, which costs one host sync (`unique`): a frequency is
        multiplied by the position, so it must be rounded exactly as transformers rounds it, and
        transformers evaluates the formula on 0-dim tensors. A batched evaluation takes CPU/GPU kernels'
        vectorised paths, whose `pow` differs in the last ulp, visible as ~1e-5 at a few thousand
        positions.
        """
        lengths = seq_lens.clamp(min=self.original_max_position)  # [num_tokens]
        distinct = torch.unique(lengths)  # [num_distinct], sorted
        rows = [self._inv_freq_for_length(length) for length in distinct]
        table = torch.stack(rows)  # [num_distinct, rotary_dim // 2]
        return table[torch.searchsorted(distinct, lengths)]  # [num_tokens, rotary_dim // 2]

    def _inv_freq_for_length(self, length: torch.Tensor) -> torch.Tensor:
        """Frequencies for one sequence length, a 0-dim integer tensor -> [rotary_dim // 2]."""
        dim = self.rotary_dim
        stretch = self.factor * length / self.original_max_position - (self.factor - 1)  # 0-dim float32
        base = self.theta * stretch ** (dim / (dim - 2))  # 0-dim float32
        return 1.0 / (base ** _rope_exponents(dim, device=length.device))  # [rotary_dim // 2]


class RotaryEmbedding(nn.Module):
    """Applies RoPE to the query and key rows of a flattened batch.

    Holds float32 cos/sin caches `[max_position, rotary_dim // 2]` (non-persistent buffers, so they are
    not part of the checkpoint and stay float32 under `module.to(dtype)`). Only the first `rotary_dim`
    dimensions of each head are rotated (partial rotary); the rest pass through unchanged.
    """

    cos_cache: torch.Tensor
    sin_cache: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        inv_freq: torch.Tensor,
        max_position: int,
        attention_scaling: float = 1.0,
        dynamic: DynamicNTKScaling | None = None,
    ) -> None:
        """`inv_freq` [rotary_dim // 2] are the (already scaled) float32 frequencies; `attention_scaling`
        multiplies cos and sin (YaRN's attention factor); `dynamic`, if given, overrides the cached
        frequencies for tokens whose sequence is longer than its original length."""
        super().__init__()
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
        if inv_freq.shape != (rotary_dim // 2,):
            raise ValueError(f"inv_freq must have shape ({rotary_dim // 2},), got {tuple(inv_freq.shape)}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.attention_scaling = attention_scaling
        self.dynamic = dynamic
        cos, sin = _cos_sin(torch.arange(max_position), inv_freq.float()[None, :], attention_scaling)
        self.register_buffer("cos_cache", cos, persistent=False)  # [max_position, rotary_dim // 2]
        self.register_buffer("sin_cache", sin, persistent=False)  # [max_position, rotary_dim // 2]

    def forward(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        seq_lens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate `query` [num_tokens, num_heads, head_dim] and `key` [num_tokens, num_kv_heads, head_dim]
        (the flat `[num_tokens, heads * head_dim]` form is accepted too) by `positions` [num_tokens].

        Returns tensors of the inputs' shapes and dtypes: new ones, except on the fused CPU path (bfloat16
        and float32, `fused_cpu.applies_to`), which rotates `query` and `key` in place and returns them. Positions must be below `max_position`,
        except with dynamic scaling, which computes long-sequence frequencies on the fly.

        `seq_lens` [num_tokens] is read only by dynamic NTK scaling: `seq_lens[t]` is the total length of
        token t's sequence in this forward (its computed tokens plus the ones scheduled now, so
        `seq_lens[t] > positions[t]`). Every token of a sequence then uses the frequencies transformers
        would use for a single forward over that sequence, whatever else is in the batch. When omitted,
        the whole batch counts as one sequence of length `max(positions) + 1`, which is what transformers
        does for a padded batch. With dynamic scaling each call syncs with the host once (see
        `DynamicNTKScaling.inv_freq`); the other types never do.
        """
        if self.dynamic is None and fused_cpu.applies_to(query) and key.dtype == query.dtype:
            # In place on the fused CPU path: query/key are views into the fused QKV output.
            return fused_cpu.rotary_embedding(
                positions, query, key, self.cos_cache, self.sin_cache, self.head_dim
            )
        cos, sin = self._cos_sin(positions, seq_lens)  # [num_tokens, rotary_dim // 2] f32 each
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _cos_sin(
        self, positions: torch.Tensor, seq_lens: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 cos and sin [num_tokens, rotary_dim // 2] for each token."""
        if self.dynamic is None:
            return self.cos_cache[positions], self.sin_cache[positions]
        if positions.numel() == 0:
            return self.cos_cache[positions], self.sin_cache[positions]
        if seq_lens is None:
            seq_lens = (positions.max() + 1).expand_as(positions)  # [num_tokens]
        # Long tokens are computed for the whole batch and selected with `where`. Positions past the
        # cache only occur in long sequences, so clamping them for the lookup never changes a used value.
        cached = positions.clamp(max=self.max_position - 1)  # [num_tokens]
        inv_freq = self.dynamic.inv_freq(seq_lens)  # [num_tokens, rotary_dim // 2]
        long_cos, long_sin = _cos_sin(positions, inv_freq, self.attention_scaling)
        is_long = (seq_lens > self.dynamic.original_max_position)[:, None]  # [num_tokens, 1]
        cos = torch.where(is_long, long_cos, self.cos_cache[cached])  # [num_tokens, rotary_dim // 2]
        sin = torch.where(is_long, long_sin, self.sin_cache[cached])  # [num_tokens, rotary_dim // 2]
        return cos, sin

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate the first `rotary_dim` dims of each head of `x`; cos/sin are float32 per token."""
        heads = x
        if x.dim() == 2:
            # unflatten, not reshape(n, -1, d): the head count must come from the last dim when n == 0.
            heads = x.unflatten(-1, (-1, self.head_dim))  # [num_tokens, num_heads, head_dim]
        # transformers rounds cos/sin to the activation dtype and rotates in that dtype.
        cos = cos.to(x.dtype)[:, None, :]  # [num_tokens, 1, rotary_dim // 2]
        sin = sin.to(x.dtype)[:, None, :]  # [num_tokens, 1, rotary_dim // 2]
        half = self.rotary_dim // 2
        x1 = heads[..., :half]  # [num_tokens, num_heads, rotary_dim // 2]
        x2 = heads[..., half : self.rotary_dim]  # [num_tokens, num_heads, rotary_dim // 2]
        # Same products and sums as `x * cos + rotate_half(x) * sin`, so results match bit for bit.
        parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        if self.rotary_dim < self.head_dim:
            parts.append(heads[..., self.rotary_dim :])  # [num_tokens, num_heads, head_dim - rotary_dim]
        return torch.cat(parts, dim=-1).reshape(x.shape)  # [num_tokens, num_heads, head_dim]

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> RotaryEmbedding:
        # `module.to(torch.bfloat16)` casts every floating buffer; the caches must stay float32 (cos/sin
        # are rounded to the activation dtype only at use), so only the device change is kept.
        caches = {name: self._buffers[name] for name in ("cos_cache", "sin_cache")}
        super()._apply(fn, recurse)
        for name, cache in caches.items():
            moved = self._buffers[name]
            assert cache is not None and moved is not None
            if moved.dtype != cache.dtype:
                self._buffers[name] = cache.to(device=moved.device)
        return self

    def extra_repr(self) -> str:
        kind = ", dynamic" if self.dynamic is not None else ""
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, max_position={self.max_position}, "
            f"attention_scaling={self.attention_scaling}{kind}"
        )


def _cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of `positions` [n] times `inv_freq` [1 or n, rotary_dim // 2], scaled, in float32."""
    # An elementwise product (not a matmul) so each angle is rounded exactly as in transformers.
    angles = positions.float()[:, None] * inv_freq  # [n, rotary_dim // 2]
    return angles.cos() * attention_scaling, angles.sin() * attention_scaling


def rope_parameters(config: transformers.PretrainedConfig, layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE parameters of `config` as one flat dict with at least `rope_type` and `rope_theta`.

    transformers 5.x keeps them in `config.rope_parameters` (nested by layer type for models such as
    Gemma 3, selected with `layer_type`); older configs used `rope_scaling` (with `type` or `rope_type`)
    next to top-level `rope_theta`, `partial_rotary_factor` and `original_max_position_embeddings`
    attributes. Both are read; the returned dict is a copy.
    """
    raw = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"rope parameters must be a dict, got {type(raw).__name__}")
    # Nested: every value is a per-layer-type dict, or None for a layer type without RoPE.
    values = [v for v in raw.values() if v is not None]
    is_nested = bool(values) and all(isinstance(v, Mapping) for v in values)
    if is_nested:
        if layer_type is None:
            raise ValueError(f"config has RoPE parameters per layer type {sorted(raw)}; pass layer_type")
        if not isinstance(raw.get(layer_type), Mapping):
            raise ValueError(f"config has no RoPE parameters for layer type {layer_type!r}")
        raw = raw[layer_type]
    params = dict(raw)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    params.pop("type", None)
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or _DEFAULT_THETA
    if params.get("partial_rotary_factor") is None:
        params["partial_rotary_factor"] = getattr(config, "partial_rotary_factor", None) or 1.0
    # Phi-3 style configs keep the pretraining length outside the rope dict; transformers prefers it.
    original = getattr(config, "original_max_position_embeddings", None)
    if original is not None:
        params["original_max_position_embeddings"] = original
    elif params.get("original_max_position_embeddings") is None:
        params["original_max_position_embeddings"] = config.max_position_embeddings
    return params


def get_rope(
    config: transformers.PretrainedConfig,
    head_dim: int,
    *,
    layer_type: str | None = None,
    max_position: int | None = None,
) -> RotaryEmbedding:
    """Build the rotary embedding `config` describes for heads of size `head_dim`.

    Supports the rope types `default`, `linear`, `dynamic`, `llama3` and `yarn` (with
    `partial_rotary_factor` for any of them), computing frequencies as transformers does. The cache
    covers positions `[0, max_position)`, by default `config.max_position_embeddings`. Raises
    ValueError for any other rope type.
    """
    params = rope_parameters(config, layer_type)
    rope_type = params["rope_type"]
    theta = float(params["rope_theta"])
    rotary_dim = int(head_dim * params["partial_rotary_factor"])
    max_position_embeddings = int(config.max_position_embeddings)
    if rope_type not in _INV_FREQ_BUILDERS:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {sorted(_INV_FREQ_BUILDERS)}")
    if rotary_dim % 2:
        raise ValueError(f"rotary dimension must be even, got {rotary_dim} (head_dim={head_dim})")
    build = _INV_FREQ_BUILDERS[rope_type]
    inv_freq, attention_scaling = build(params, theta, rotary_dim, max_position_embeddings)
    dynamic = None
    if rope_type == "dynamic":
        dynamic = DynamicNTKScaling(theta, float(params["factor"]), max_position_embeddings, rotary_dim)
    return RotaryEmbedding(
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        inv_freq=inv_freq,
        max_position=max_position or max_position_embeddings,
        attention_scaling=attention_scaling,
        dynamic=dynamic,
    )


# Each builder maps (rope params, theta, rotary_dim, max_position_embeddings) to float32 frequencies
# [rotary_dim // 2] and the factor applied to cos/sin.
_Params = dict[str, Any]
_InvFreq = tuple[torch.Tensor, float]
_InvFreqBuilder = Callable[[_Params, float, int, int], _InvFreq]


def _default_inv_freq(params: _Params, theta: float, dim: int, max_pos: int) -> _InvFreq:
    return _base_inv_freq(theta, dim), 1.0


def _linear_inv_freq(params: _Params, theta: float, dim: int, max_pos: int) -> _InvFreq:
    # Dividing positions by `factor` is the same as dividing the frequencies by it.
    return _base_inv_freq(theta, dim) / params["factor"], 1.0


def _dynamic_inv_freq(params: _Params, theta: float, dim: int, max_pos: int) -> _InvFreq:
    # The cache serves sequences no longer than the original length, where the NTK stretch is 1;
    # the expression is kept (not short-cut to `theta`) because transformers evaluates it too.
    factor = params["factor"]
    stretch = factor * max_pos / max_pos - (factor - 1)
    return _base_inv_freq(theta * stretch ** (dim / (dim - 2)), dim), 1.0


def _llama3_inv_freq(params: _Params, theta: float, dim: int, max_pos: int) -> _InvFreq:
    # Llama 3.1: wavelengths shorter than original/high_freq_factor are kept, those longer than
    # original/low_freq_factor are divided by `factor`, and the band between is blended linearly in
    # `original / wavelength`.
    inv_freq = _base_inv_freq(theta, dim)  # [dim // 2]
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq  # [dim // 2]
    is_low = wavelen > original / low_freq_factor  # [dim // 2]
    is_high = wavelen < original / high_freq_factor  # [dim // 2]
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)  # [dim // 2]
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq  # [dim // 2]
    scaled = torch.where(is_low, inv_freq / factor, inv_freq)  # [dim // 2]
    return torch.where(~is_low & ~is_high, blended, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(params: _Params, theta: float, dim: int, max_pos: int) -> _InvFreq:
    # YaRN: high-frequency dims (many rotations within the original context) extrapolate unchanged,
    # low-frequency dims are interpolated by `factor`, with a linear ramp over the dims in between.
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_pos / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def dim_for_rotations(rotations: float) -> float:
        # The (fractional) dim index whose wavelength fits `rotations` times into the original context.
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for_rotations(beta_fast), dim_for_rotations(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [dim // 2]
    extrapolation_weight = 1 - ramp  # [dim // 2]
    pos_freqs = theta ** _rope_exponents(dim)  # [dim // 2]
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (
        1.0 / pos_freqs
    ) * extrapolation_weight  # [dim // 2]
    return inv_freq, float(attention_factor)


_INV_FREQ_BUILDERS: dict[str, _InvFreqBuilder] = {
    "default": _default_inv_freq,
    "linear": _linear_inv_freq,
    "dynamic": _dynamic_inv_freq,
    "llama3": _llama3_inv_freq,
    "yarn": _yarn_inv_freq,
}
