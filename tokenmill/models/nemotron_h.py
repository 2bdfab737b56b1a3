"""Nemotron-H: a hybrid of Mamba-2 layers, attention layers and MLP layers, one mixer per block.

``config.layers_block_type`` names each block's mixer: ``linear_attention`` (Mamba-2), ``full_attention``
(grouped-query attention without positional encoding), ``mlp`` (``down(relu(up(x))^2)``); ``moe``
blocks are refused for now. Every block is ``x + mixer(rms_norm(x))``. Only attention blocks use the
paged KV cache (``num_layers`` counts them); each Mamba-2 block keeps its convolution inputs
``[conv_dim, kernel - 1]`` and its SSM state ``[heads, head_dim, state_size]`` per sequence in a slot
of the state pool, exactly as Qwen3-Next's linear layers do (``models/qwen3_next.py``,
``core/kv/hybrid.py``).

As transformers' ``NemotronHForCausalLM`` computes it (its torch fallbacks are the reference):
``in_proj`` gives the gate, the convolution's input (x, B, C) and dt; a depthwise causal convolution
with bias and SiLU; the SSD scan (``layers/mamba2.py``) with ``dt = clamp(softplus(dt + dt_bias))`` and
``A = -exp(A_log)`` plus the ``D`` skip; a grouped RMSNorm of ``y * silu(gate)``; ``out_proj``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.attention import select_backend
from tokenmill.layers.embedding import LMHead, VocabEmbedding
from tokenmill.layers.forward_batch import ForwardBatch
from tokenmill.layers.linear import ColumnParallelLinear, MergedColumnLinear, RowParallelLinear
from tokenmill.layers.recurrent_kernel import causal_conv, causal_conv_step, chunked_scan, scan_step
from tokenmill.layers.recurrent_state import RecurrentSequence
from tokenmill.models.base import CausalLM
from tokenmill.models.weights import load_hf_weights
from tokenmill.step_control import LayerProgress


class NemotronRMSNorm(nn.Module):
    """RMSNorm with the weight applied in float32 before rounding (Nemotron-H's)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed).to(x.dtype)


class Conv1dWeights(nn.Module):
    """The checkpoint's depthwise ``conv1d`` (``weight [channels, 1, kernel]``, ``bias [channels]``)."""

    def __init__(self, channels: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(channels), requires_grad=False) if bias else None


class GroupWeight(nn.Module):
    """Holds the gated group norm's ``norm.weight`` ``[inner]`` (applied in ``Mamba2Mixer._gated_norm``)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class Mamba2Mixer(nn.Module):
    def __init__(self, config, state_index: int, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.state_index = state_index
        self.num_heads = config.mamba_num_heads
        self.head_dim = config.mamba_head_dim
        self.state_size = config.ssm_state_size
        self.groups = config.n_groups
        self.kernel = config.conv_kernel
        self.chunk = config.chunk_size
        self.dt_min, self.dt_max = (float(v) for v in config.time_step_limit)
        self.inner = self.num_heads * self.head_dim
        self.conv_dim = self.inner + 2 * self.groups * self.state_size
        if config.mamba_hidden_act != "silu":
            raise ValueError(f"Nemotron-H mamba_hidden_act {config.mamba_hidden_act!r} is not supported")
        hidden = config.hidden_size
        self.in_proj = ColumnParallelLinear(
            hidden, self.inner + self.conv_dim + self.num_heads, config.use_bias, dtype
        )
        self.conv1d = Conv1dWeights(self.conv_dim, self.kernel, bool(config.use_conv_bias))
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.ones(self.num_heads), requires_grad=False)
        self.norm = GroupWeight(self.inner)
        self.norm_eps = config.layer_norm_epsilon
        self.out_proj = RowParallelLinear(self.inner, hidden, config.use_bias, dtype)

    def state_shapes(self, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [
            ((self.conv_dim, self.kernel - 1), dtype),
            ((self.num_heads, self.head_dim, self.state_size), torch.float32),
        ]

    def _scan_inputs(
        self, conv_out: torch.Tensor, dt_raw: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x [n, heads, head_dim], dt [n, heads], B, C [n, heads, state_size])`` in float32."""
        n = conv_out.shape[0]
        group_size = self.groups * self.state_size
        x, b, c = torch.split(conv_out.float(), [self.inner, group_size, group_size], dim=-1)
        repeat = self.num_heads // self.groups
        b = b.reshape(n, self.groups, self.state_size).repeat_interleave(repeat, dim=1)
        c = c.reshape(n, self.groups, self.state_size).repeat_interleave(repeat, dim=1)
        dt = F.softplus(dt_raw.float() + self.dt_bias.float()).clamp(self.dt_min, self.dt_max)
        return x.reshape(n, self.num_heads, self.head_dim), dt, b, c

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        state = batch.recurrent
        assert state is not None, "a Mamba-2 layer needs the batch's recurrent state"
        conv_states, ssm_states = state.caches[self.state_index]
        n = hidden.shape[0]
        gate, xbc, dt_raw = torch.split(
            self.in_proj(hidden), [self.inner, self.conv_dim, self.num_heads], dim=-1
        )
        y = torch.empty(n, self.num_heads, self.head_dim, dtype=torch.float32, device=hidden.device)
        weight, bias = self.conv1d.weight[:, 0, :], self.conv1d.bias
        a = -self.A_log.float().exp()  # [heads]
        if state.decodes:
            rows, slots = state.decode_rows, state.decode_slots
            conv_out, conv_states[slots] = causal_conv_step(xbc[rows], conv_states[slots], weight, bias)
            x, dt, b, c = self._scan_inputs(conv_out, dt_raw[rows])
            out, ssm_states[slots] = scan_step(x, dt, a, b, c, ssm_states[slots])
            y[rows] = out + self.D.float()[:, None] * x
            for seq in state.decodes:
                for _, snapshot in seq.checkpoints:
                    conv_states[snapshot] = conv_states[seq.slot]
                    ssm_states[snapshot] = ssm_states[seq.slot]
        for seq in state.prefills:
            self._prefill(seq, xbc, dt_raw, a, weight, bias, conv_states, ssm_states, y)
        return self.out_proj(self._gated_norm(y.reshape(n, self.inner), gate))  # [n, hidden_size]

    def _prefill(
        self,
        seq: RecurrentSequence,
        xbc: torch.Tensor,
        dt_raw: torch.Tensor,
        a: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_states: torch.Tensor,
        ssm_states: torch.Tensor,
        y: torch.Tensor,
    ) -> None:
        lo, hi = seq.first_row, seq.first_row + seq.num_tokens
        ends = sorted({offset for offset, _ in seq.checkpoints} | {seq.num_tokens})
        conv_out, conv_after = causal_conv(xbc[lo:hi], conv_states[seq.slot], weight, ends, bias)
        x, dt, b, c = self._scan_inputs(conv_out, dt_raw[lo:hi])
        s = ssm_states[seq.slot]
        ssm_after: dict[int, torch.Tensor] = {}
        start = 0
        for end in ends:  # pieces end where a snapshot is wanted
            part = slice(start, end)
            out, s = chunked_scan(x[part], dt[part], a, b[part], c[part], s, self.chunk)
            y[lo + start : lo + end] = out + self.D.float()[:, None] * x[part]
            ssm_after[end] = s
            start = end
        conv_by_end = dict(zip(ends, conv_after))
        for offset, snapshot in seq.checkpoints:
            conv_states[snapshot] = conv_by_end[offset]
            ssm_states[snapshot] = ssm_after[offset]
        conv_states[seq.slot] = conv_by_end[seq.num_tokens]
        ssm_states[seq.slot] = s

    def _gated_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm per group of ``y * silu(gate)`` ``[n, inner]``, in float32, rounded after the weight."""
        n = y.shape[0]
        gated = (y.float() * F.silu(gate.float())).view(n, self.groups, -1)
        normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        return (self.norm.weight.float() * normed.view(n, self.inner)).to(gate.dtype)


class PlainAttention(nn.Module):
    """Grouped-query attention with no positional encoding (Nemotron-H's attention blocks)."""

    def __init__(self, config, kv_index: int, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.kv_index = kv_index
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = MergedColumnLinear(
            config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias, dtype
        )
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, bias, dtype)
        backend = select_backend(torch.get_default_device(), dtype)
        self.attn = backend(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.reshape(n, self.num_heads, self.head_dim)  # [n, heads, head_dim]
        k = k.reshape(n, self.num_kv_heads, self.head_dim)  # [n, kv_heads, head_dim]
        v = v.reshape(n, self.num_kv_heads, self.head_dim)  # [n, kv_heads, head_dim]
        out = self.attn.forward(q, k, v, batch.kv_caches[self.kv_index], batch.attn)
        return self.o_proj(out.reshape(n, -1))  # [n, hidden_size]


class SquaredReluMLP(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        if config.mlp_hidden_act != "relu2":
            raise ValueError(f"Nemotron-H mlp_hidden_act {config.mlp_hidden_act!r} is not supported")
        bias = bool(config.mlp_bias)
        # The weight loader puts every `up_proj` into a merged `gate_up_proj`; this one has no gate.
        self.gate_up_proj = MergedColumnLinear(
            config.hidden_size, {"up": config.intermediate_size}, bias, dtype
        )
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias, dtype)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.down_proj(torch.relu(self.gate_up_proj(hidden)).square())


class NemotronHBlock(nn.Module):
    def __init__(self, mixer: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = NemotronRMSNorm(hidden_size, eps)
        self.mixer = mixer

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return hidden + self.mixer(self.norm(hidden), batch)


class NemotronHForCausalLM(CausalLM):
    """NemotronHForCausalLM over the paged KV cache (attention blocks) and the state pool."""

    def __init__(self, config, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.dtype = dtype
        kinds = list(config.layers_block_type)
        if "moe" in kinds:
            raise ValueError("Nemotron-H mixture-of-experts blocks are not supported yet")
        self.embeddings = VocabEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.mamba_layers: list[Mamba2Mixer] = []
        self.kv_layers = 0
        blocks = []
        for kind in kinds:
            mixer: nn.Module
            if kind == "linear_attention":
                mixer = Mamba2Mixer(config, len(self.mamba_layers), dtype)
                self.mamba_layers.append(mixer)
            elif kind == "full_attention":
                mixer = PlainAttention(config, self.kv_layers, dtype)
                self.kv_layers += 1
            elif kind == "mlp":
                mixer = SquaredReluMLP(config, dtype)
            else:
                raise ValueError(f"unsupported Nemotron-H block type {kind!r}")
            blocks.append(NemotronHBlock(mixer, config.hidden_size, config.layer_norm_epsilon))
        self.layers = nn.ModuleList(blocks)
        self.norm_f = NemotronRMSNorm(config.hidden_size, config.layer_norm_epsilon)
        tied = self.embeddings if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, dtype, tied_to=tied)
        self._num_kv_heads = config.num_key_value_heads
        self._head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    @property
    def num_layers(self) -> int:
        """The blocks with a KV cache: the attention ones."""
        return self.kv_layers

    @property
    def num_kv_heads(self) -> int:
        return self._num_kv_heads

    @property
    def head_dim(self) -> int:
        return self._head_dim

    def recurrent_state_layout(self) -> list[list[tuple[tuple[int, ...], torch.dtype]]]:
        """Per Mamba-2 block, the shape (per slot) and dtype of each of its state tensors."""
        return [layer.state_shapes(self.dtype) for layer in self.mamba_layers]

    def forward(self, batch: ForwardBatch) -> torch.Tensor | LayerProgress:
        """Every token's final hidden state; a stop is honoured only before the first block (its
        Mamba-2 blocks update their states in place)."""
        if batch.resume_from is None and batch.control.should_stop(0):
            return LayerProgress(0, self.embeddings(batch.input_ids), None)
        hidden = self.embeddings(batch.input_ids)  # [num_tokens, hidden_size]
        for block in self.layers:
            hidden = block(hidden, batch)
        return self.norm_f(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [num_rows, vocab_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Hugging Face tensors (``model.`` or the original ``backbone.`` prefix); the
        multi-token-prediction blocks (``mtp.*``) are skipped."""
        renamed = (
            ("model." + name.removeprefix("backbone.") if name.startswith("backbone.") else name, tensor)
            for name, tensor in weights
            if not name.startswith("mtp.")
        )
        return load_hf_weights(self, renamed)
