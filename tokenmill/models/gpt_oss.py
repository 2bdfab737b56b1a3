"""gpt-oss: attention sinks, alternating sliding/full layers and a biased top-k MoE, as transformers computes it.

What sets it apart, each read from the Hugging Face ``GptOssConfig`` in ``GptOssArgs``:

- Attention sinks: every head has a learned logit (``self_attn.sinks``) that joins its softmax
  denominator as a key without a value, so a query may attend "nowhere". It goes to the attention
  backend as the ``sinks`` argument; backends whose kernels lack it use the reference's code.
- ``layer_types`` alternates ``sliding_attention`` (the last ``sliding_window`` positions) with
  ``full_attention``; biases on q/k/v/o (``attention_bias``); YaRN rotary scaling (``rope_parameters``).
- The MoE: a router with a bias, the top ``num_experts_per_tok`` logits softmaxed among themselves;
  experts with biases whose gated unit is a clamped SwiGLU: ``gate`` clamped above at ``limit``,
  ``up`` clamped to ``[-limit, limit]``, out ``(up + 1) * gate * sigmoid(alpha * gate)``.
  Checkpoints interleave gate and up columns (gate even, up odd); they are de-interleaved at load.
- Real checkpoints hold the experts in MXFP4 (``*_blocks`` / ``*_scales``, ``layers/mxfp4.py``); they
  are dequantized on load on CPU into the model dtype, and the start-up log says how much memory that
  takes against the packed size.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.layers.attention import select_backend
from tokenmill.layers.embedding import LMHead, VocabEmbedding
from tokenmill.layers.forward_batch import ForwardBatch
from tokenmill.layers.fused_moe import FusedExperts, topk_then_softmax
from tokenmill.layers.linear import LinearBase, MergedColumnLinear, RowParallelLinear
from tokenmill.layers.mxfp4 import dequantize_mxfp4
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding, get_rope
from tokenmill.models.base import CausalLM
from tokenmill.models.weights import load_hf_weights
from tokenmill.step_control import LayerProgress

logger = logging.getLogger(__name__)

SLIDING, FULL = "sliding_attention", "full_attention"
# model.layers.N.mlp.experts.gate_up_proj[_bias|_blocks|_scales], and down_proj's
_EXPERT_TENSOR = re.compile(
    r"^(?P<experts>layers\.\d+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)(?P<kind>_bias|_blocks|_scales)?$"
)


@dataclass
class GptOssArgs:
    """The hyper-parameters this file reads from a Hugging Face ``GptOssConfig``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    layer_types: list[str]
    sliding_window: int
    num_experts: int
    top_k: int
    swiglu_alpha: float
    swiglu_limit: float
    tie_word_embeddings: bool
    mxfp4: bool  # the checkpoint's experts are MXFP4 (quantization_config.quant_method)

    @classmethod
    def from_hf(cls, config) -> GptOssArgs:  # type: ignore[no-untyped-def]
        """Read ``config``; ValueError for what we do not reproduce (another quantization, bad layer types)."""
        num_layers = int(config.num_hidden_layers)
        layer_types = list(getattr(config, "layer_types", None) or [])
        if not layer_types:  # transformers' default: sliding first, then alternating
            layer_types = [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
        if len(layer_types) != num_layers or set(layer_types) - {SLIDING, FULL}:
            raise ValueError(f"gpt-oss layer_types must be {num_layers} of {SLIDING}/{FULL}: {layer_types}")
        sliding_window = getattr(config, "sliding_window", None)
        if SLIDING in layer_types and not sliding_window:
            raise ValueError("gpt-oss config has sliding layers but no sliding_window")
        quantization = getattr(config, "quantization_config", None) or {}
        if not isinstance(quantization, dict):
            quantization = quantization.to_dict()
        method = quantization.get("quant_method")
        if method not in (None, "mxfp4"):
            raise ValueError(
                f"gpt-oss with quantization {method!r} is not supported natively (MXFP4 and unquantized "
                "checkpoints are); try --model-impl transformers"
            )
        num_heads = int(config.num_attention_heads)
        return cls(
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // num_heads),
            rms_norm_eps=float(config.rms_norm_eps),
            attention_bias=bool(getattr(config, "attention_bias", True)),
            layer_types=layer_types,
            sliding_window=int(sliding_window or 0),
            num_experts=int(config.num_local_experts),
            top_k=int(config.num_experts_per_tok),
            swiglu_alpha=float(getattr(config, "swiglu_alpha", 1.702)),
            swiglu_limit=float(getattr(config, "swiglu_limit", 7.0)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            mxfp4=method == "mxfp4",
        )

    def window_of(self, layer_index: int) -> int | None:
        """The layer's attention window in positions, None for a full-attention layer."""
        return self.sliding_window if self.layer_types[layer_index] == SLIDING else None


class GptOssAttention(nn.Module):
    """GQA with biases, rotary and one learned sink logit per query head."""

    def __init__(
        self, args: GptOssArgs, rotary: RotaryEmbedding, sliding_window: int | None, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.num_heads = args.num_heads
        self.num_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        self.sliding_window = sliding_window
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_proj = MergedColumnLinear(
            args.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=args.attention_bias, dtype=dtype
        )
        self.o_proj = RowParallelLinear(q_size, args.hidden_size, bias=args.attention_bias, dtype=dtype)
        self.sinks = nn.Parameter(torch.zeros(args.num_heads, dtype=dtype), requires_grad=False)
        self.rotary = rotary  # shared by every layer
        backend = select_backend(torch.get_default_device(), dtype)
        self.attn = backend(args.num_heads, args.num_kv_heads, args.head_dim, args.head_dim**-0.5)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, layer_index: int) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, kv_heads, head_dim]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, kv_heads, head_dim]
        q, k = self.rotary(batch.positions, q, k, batch.seq_lens)
        metadata = batch.attention(self.sliding_window)
        out = self.attn.forward(q, k, v, batch.kv_caches[layer_index], metadata, sinks=self.sinks)
        return self.o_proj(out.reshape(num_tokens, -1))  # [num_tokens, hidden_size]


class GptOssExperts(FusedExperts):
    """gpt-oss's experts: biases on both projections and the clamped SwiGLU (module docstring).

    ``load_checkpoint_tensor`` takes the checkpoint's stacked tensors: ``gate_up_proj [E, hidden,
    2 * intermediate]`` with gate and up interleaved, ``gate_up_proj_bias [E, 2 * intermediate]``
    (interleaved too), ``down_proj [E, intermediate, hidden]``, ``down_proj_bias [E, hidden]``, and the
    MXFP4 pairs ``gate_up_proj_blocks/_scales`` (rows of ``[E, 2 * intermediate, hidden]``, interleaved)
    and ``down_proj_blocks/_scales`` (rows of ``[E, hidden, intermediate]``).
    """

    def __init__(self, args: GptOssArgs, dtype: torch.dtype) -> None:
        super().__init__(args.num_experts, args.hidden_size, args.intermediate_size, "silu", dtype, bias=True)
        self.alpha = args.swiglu_alpha
        self.limit = args.swiglu_limit
        self._pending: dict[str, dict[str, torch.Tensor]] = {}  # MXFP4 halves waiting for their pair

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # [rows, intermediate] each (de-interleaved at load)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))  # [rows, intermediate]

    def load_checkpoint_tensor(self, proj: str, kind: str, tensor: torch.Tensor) -> bool:
        """Load one checkpoint tensor of ``proj`` (``gate_up_proj``/``down_proj``) and ``kind`` (``""``,
        ``_bias``, ``_blocks``, ``_scales``); returns False while an MXFP4 half waits for its pair."""
        if kind in ("_blocks", "_scales"):
            halves = self._pending.setdefault(proj, {})
            halves[kind] = tensor
            if len(halves) < 2:
                return False
            del self._pending[proj]
            self._load_mxfp4(proj, halves["_blocks"], halves["_scales"])
        elif kind == "_bias":
            target = self.w13_bias if proj == "gate_up_proj" else self.w2_bias
            assert target is not None
            if proj == "gate_up_proj":
                tensor = torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)  # [E, 2I]: gate, then up
            _copy_checked(target.data, tensor, f"{proj}_bias")
        elif proj == "gate_up_proj":  # [E, hidden, 2I] interleaved -> [E, 2I, hidden] gate rows, then up
            _copy_checked(
                self.w13.data, torch.cat([tensor[:, :, 0::2], tensor[:, :, 1::2]], 2).transpose(1, 2), proj
            )
        else:  # down_proj [E, I, hidden] -> [E, hidden, I]
            _copy_checked(self.w2.data, tensor.transpose(1, 2), proj)
        return True

    def _load_mxfp4(self, proj: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        # One expert at a time, so the float temporaries stay one expert's size.
        target = self.w13.data if proj == "gate_up_proj" else self.w2.data
        if blocks.shape[0] != self.num_experts:
            raise ValueError(f"{proj}_blocks has {blocks.shape[0]} experts, the model {self.num_experts}")
        for expert in range(self.num_experts):
            weight = dequantize_mxfp4(blocks[expert], scales[expert], torch.float32)  # [rows, columns]
            if proj == "gate_up_proj":
                weight = torch.cat([weight[0::2], weight[1::2]])  # [2I, hidden]: gate rows, then up
            _copy_checked(target[expert], weight, f"{proj}_blocks")

    def check_complete(self) -> None:
        """ValueError when an MXFP4 blocks tensor came without its scales (or the reverse)."""
        if self._pending:
            missing = {proj: sorted({"_blocks", "_scales"} - set(h)) for proj, h in self._pending.items()}
            raise ValueError(f"MXFP4 expert tensors without their pair: {missing}")


def _copy_checked(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(f"checkpoint tensor {name} {tuple(tensor.shape)} does not fit {tuple(target.shape)}")
    target.copy_(tensor)


class GptOssMoE(nn.Module):
    """The router (a biased linear; top-k logits softmaxed among themselves) and the experts."""

    def __init__(self, args: GptOssArgs, dtype: torch.dtype) -> None:
        super().__init__()
        self.router = LinearBase(args.hidden_size, args.num_experts, bias=True, dtype=dtype)
        self.experts = GptOssExperts(args, dtype)
        self.route = functools.partial(topk_then_softmax, top_k=args.top_k)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        router_logits = self.router(hidden)  # [num_tokens, num_experts]
        weights, expert_ids = self.route(router_logits)  # [num_tokens, top_k] each
        return self.experts(hidden, weights, expert_ids)  # [num_tokens, hidden_size]


class GptOssDecoderLayer(nn.Module):
    """Pre-norm attention and MoE with residuals (the Llama layout)."""

    def __init__(
        self, args: GptOssArgs, layer_index: int, rotary: RotaryEmbedding, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = GptOssAttention(args, rotary, args.window_of(layer_index), dtype)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = GptOssMoE(args, dtype)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, layer_index: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, batch, layer_index)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class GptOssForCausalLM(CausalLM):
    """gpt-oss over a paged KV cache (transformers' ``GptOssForCausalLM``).

    ``layer_sliding_windows`` tells the model runner which attention metadata each layer needs; since
    half the layers attend globally, the KV manager keeps every block of a sequence.
    """

    def __init__(self, config, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        args = GptOssArgs.from_hf(config)
        self.args = args
        self.embed_tokens = VocabEmbedding(args.vocab_size, args.hidden_size, dtype)
        self.rotary = get_rope(config, args.head_dim)
        self.layers = nn.ModuleList(
            [GptOssDecoderLayer(args, i, self.rotary, dtype) for i in range(args.num_layers)]
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        tied = self.embed_tokens if args.tie_word_embeddings else None
        self.lm_head = LMHead(args.vocab_size, args.hidden_size, dtype, tied_to=tied)
        if args.mxfp4:
            _log_mxfp4_memory(args, dtype)

    window_kv_group = True  # the sliding layers' blocks are freed behind the window (core/kv/window_group.py)

    @property
    def sliding_window(self) -> int | None:
        """A window shared by every layer, or None: the full layers see the whole sequence."""
        windows = set(self.layer_sliding_windows)
        return windows.pop() if len(windows) == 1 else None

    @property
    def layer_sliding_windows(self) -> list[int | None]:
        return [self.args.window_of(i) for i in range(self.args.num_layers)]

    @property
    def num_kv_heads(self) -> int:
        return self.args.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.args.head_dim

    @property
    def num_layers(self) -> int:
        return self.args.num_layers

    def forward(self, batch: ForwardBatch) -> torch.Tensor | LayerProgress:
        """Every token's final hidden state ``[num_tokens, hidden_size]``, or the ``LayerProgress``
        before the layer where ``batch.control`` stopped the pass; a paused pass goes on from
        ``batch.resume_from`` (step_control.py)."""
        progress = batch.resume_from
        if progress is None:
            hidden = self.embed_tokens(batch.input_ids)  # [num_tokens, hidden_size]
            residual: torch.Tensor | None = None
            start = 0
        else:
            hidden, residual, start = progress.hidden, progress.residual, progress.next_layer
        for index in range(start, len(self.layers)):
            if batch.control.should_stop(index):  # a latency-critical arrival stops the step here
                return LayerProgress(index, hidden, residual)
            hidden, residual = self.layers[index](hidden, residual, batch, index)
        hidden, _ = self.norm(hidden, residual)
        return hidden  # [num_tokens, hidden_size]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [num_rows, vocab_size] activation dtype

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (Hugging Face ``GptOssForCausalLM`` names); returns the names used.

        Expert tensors (plain, or MXFP4 blocks and scales in either order) go to each layer's
        ``GptOssExperts``; everything else through ``load_hf_weights``. Unknown names, shape mismatches
        and an MXFP4 half without its pair raise ValueError.
        """
        loaded: set[str] = set()
        rest = self._load_experts(weights, loaded)
        loaded |= load_hf_weights(self, rest)
        for module in self.modules():
            if isinstance(module, GptOssExperts):
                module.check_complete()
        return loaded

    def _load_experts(
        self, weights: Iterable[tuple[str, torch.Tensor]], loaded: set[str]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        modules = dict(self.named_modules())
        for name, tensor in weights:
            match = _EXPERT_TENSOR.match(name.removeprefix("model."))
            if match is None:
                yield name, tensor
                continue
            experts = modules.get(match["experts"])
            if not isinstance(experts, GptOssExperts):
                raise ValueError(f"checkpoint tensor {name} has no place in this model")
            experts.load_checkpoint_tensor(match["proj"], match["kind"] or "", tensor)
            loaded.add(name)


def _log_mxfp4_memory(args: GptOssArgs, dtype: torch.dtype) -> None:
    """Say what dequantizing the MXFP4 experts costs: their size in ``dtype`` against the packed size."""
    per_layer = args.num_experts * 3 * args.intermediate_size * args.hidden_size  # gate, up, down
    elements = per_layer * args.num_layers
    unpacked = elements * torch.finfo(dtype).bits // 8
    packed = elements // 2 + elements // 32  # 4 bits a value, one byte of scale per 32
    logger.warning(
        "the checkpoint's experts are MXFP4: they are dequantized on load to %s, %.2f GB of expert weights "
        "in memory (%.2f GB packed in the checkpoint); no MXFP4 kernel computes on the packed form yet",
        str(dtype).removeprefix("torch."),
        unpacked / 1e9,
        packed / 1e9,
    )
