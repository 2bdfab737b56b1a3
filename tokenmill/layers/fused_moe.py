"""Mixture-of-experts feed-forward: routing, the experts' stacked weights, and the sparse block.

Every expert is a gated MLP (``down(act(gate(x)) * up(x))``). Their weights are stacked at load
time into ``w13 [num_experts, 2 * intermediate, hidden]`` (gate rows, then up rows) and
``w2 [num_experts, hidden, intermediate]``, so that the forward never touches per-expert modules.
The expert computation groups the (token, expert) pairs by expert with one sort and runs two
matmuls per expert that received tokens; there is no Python loop over tokens.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.batch_invariant import row_tiled
from tokenmill.layers.linear import LinearBase
from tokenmill.layers.tensor_parallel import SINGLE, TensorParallel

# The names checkpoints use for an expert's three projections, mapped to ours.
EXPERT_SHARDS = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
}
_PER_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
_STACKED = re.compile(r"^(?P<experts>.+\.experts)\.(?P<name>gate_up_proj|down_proj)$")


def topk_then_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's routing: the ``top_k`` largest logits, softmaxed among themselves (float32).

    Returns ``(weights [num_tokens, top_k] float32, expert_ids [num_tokens, top_k] int64)``. This is
    the same as a softmax over all experts followed by renormalising the top ``k``.
    """
    top_logits, expert_ids = torch.topk(router_logits.float(), top_k, dim=-1)  # [num_tokens, top_k]
    return torch.softmax(top_logits, dim=-1), expert_ids


def softmax_then_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-MoE routing: softmax over every expert (float32), keep the ``top_k`` largest
    probabilities, and divide them by their sum only when ``renormalize`` (``norm_topk_prob``).

    Returns ``(weights [num_tokens, top_k] float32, expert_ids [num_tokens, top_k] int64)``.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)  # [num_tokens, num_experts]
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)  # [num_tokens, top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids


class FusedExperts(nn.Module):
    """``num_experts`` gated MLPs in two stacked weights.

    Under tensor parallelism every rank holds every expert's slice of the intermediate dimension
    (``intermediate_size / tp.size`` gate, up and down features: column- then row-parallel); with
    ``tp.expert_parallel`` each rank holds ``num_experts / tp.size`` whole experts instead, and
    tokens routed elsewhere add nothing here. Either way ``forward`` returns this rank's partial sum
    and ``SparseMoeBlock`` all-reduces it.

    ``forward(hidden, weights, expert_ids)`` returns ``sum_k weights[t, k] * expert_{ids[t, k]}(hidden[t])``
    for every token ``t``. Checkpoint tensors load one expert projection at a time
    (``load_expert``) or already stacked (``load_stacked``, transformers' in-memory layout).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.tp = tp
        self.expert_parallel = tp.expert_parallel and tp.size > 1
        if self.expert_parallel:  # whole experts, a run of them per rank
            self.first_expert, self.num_local_experts = tp.even_range(num_experts, "the experts")
            self.slice_parts, self.slice_index = 1, 0
        else:  # every expert, a slice of its intermediate features per rank
            self.first_expert, self.num_local_experts = 0, num_experts
            self.slice_parts, self.slice_index = tp.size, tp.rank
            intermediate_size = tp.even_range(intermediate_size, "the experts' intermediate features")[1]
        self.intermediate_size = intermediate_size  # this rank's
        self.w13 = nn.Parameter(
            torch.empty(self.num_local_experts, 2 * intermediate_size, hidden_size, dtype=dtype),
            requires_grad=False,
        )
        self.w2 = nn.Parameter(
            torch.empty(self.num_local_experts, hidden_size, intermediate_size, dtype=dtype),
            requires_grad=False,
        )
        # Per-expert biases of both projections (gpt-oss has them), [local experts, out_features].
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        if bias:
            self.w13_bias = nn.Parameter(
                torch.zeros(self.num_local_experts, 2 * intermediate_size, dtype=dtype), requires_grad=False
            )
            self.w2_bias = nn.Parameter(
                torch.zeros(self.num_local_experts, hidden_size, dtype=dtype), requires_grad=False
            )
        self.act = expert_activation(hidden_act)
        self.row_tile = 0  # deterministic mode: see LinearBase.row_tile

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` of ``gate_up [rows, 2 * intermediate]`` (gate first): ``[rows, intermediate]``.
        A family with another gating (gpt-oss's clamped SwiGLU) overrides this."""
        gate, up = gate_up.chunk(2, dim=-1)  # [rows, intermediate] each
        return self.act(gate) * up

    def load_expert(self, expert_id: int, shard: str, tensor: torch.Tensor) -> None:
        """Place one expert's ``gate``/``up`` ([intermediate, hidden]) or ``down`` ([hidden, intermediate])."""
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert {expert_id} out of range: this layer has {self.num_experts} experts")
        local = expert_id - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert (expert parallelism)
        size, parts, index = self.intermediate_size, self.slice_parts, self.slice_index
        if shard == "down":
            target = self.w2.data[local]
            if parts > 1 and tensor.shape[-1] == size * parts:
                tensor = tensor.narrow(1, index * size, size)
        elif shard in ("gate", "up"):
            target = self.w13.data[local].narrow(0, 0 if shard == "gate" else size, size)
            if parts > 1 and tensor.shape[0] == size * parts:
                tensor = tensor.narrow(0, index * size, size)
        else:
            raise ValueError(f"unknown expert projection {shard!r}")
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"expert {shard} tensor {tuple(tensor.shape)} does not fit {tuple(target.shape)}"
            )
        target.copy_(tensor)

    def load_stacked(self, name: str, tensor: torch.Tensor) -> None:
        """Load ``gate_up_proj`` ([E, 2 * intermediate, hidden], gate first) or ``down_proj`` ([E, hidden, intermediate])."""
        target = {"gate_up_proj": self.w13, "down_proj": self.w2}.get(name)
        if target is not None and self.expert_parallel and tensor.shape[0] == self.num_experts:
            tensor = tensor.narrow(0, self.first_expert, self.num_local_experts)
        elif target is not None and self.slice_parts > 1:
            tensor = self._stacked_slice(name, tensor)
        if target is None or target.shape != tensor.shape:
            raise ValueError(f"stacked expert tensor {name} {tuple(tensor.shape)} does not fit this layer")
        target.data.copy_(tensor)

    def _stacked_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a stacked checkpoint tensor (unchanged when it does not have the
        full intermediate size: the shape check then names the mismatch)."""
        size, rank, full = self.intermediate_size, self.slice_index, self.intermediate_size * self.slice_parts
        if name == "down_proj" and tensor.dim() == 3 and tensor.shape[2] == full:
            return tensor.narrow(2, rank * size, size)
        if name == "gate_up_proj" and tensor.dim() == 3 and tensor.shape[1] == 2 * full:
            gate, up = tensor.chunk(2, dim=1)  # [E, full, hidden] each
            return torch.cat([gate.narrow(1, rank * size, size), up.narrow(1, rank * size, size)], dim=1)
        return tensor

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        weights: torch.Tensor,  # [num_tokens, top_k] float32
        expert_ids: torch.Tensor,  # [num_tokens, top_k] int64
    ) -> torch.Tensor:
        top_k = expert_ids.shape[1]
        flat_ids = expert_ids.reshape(-1)  # [num_tokens * top_k]
        # A stable sort keeps each expert's tokens in batch order, so results do not depend on the sort.
        order = torch.argsort(flat_ids, stable=True)  # [num_pairs]
        token_rows = order // top_k  # [num_pairs]: the token behind each sorted (token, expert) pair
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()  # one device sync
        grouped = hidden.index_select(0, token_rows)  # [num_pairs, hidden_size]
        # Pairs of experts another rank holds (expert parallelism) stay zero here.
        expert_out = torch.zeros_like(grouped) if self.expert_parallel else torch.empty_like(grouped)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            local = expert - self.first_expert
            if 0 <= local < self.num_local_experts:
                rows = grouped[start : start + count]  # [count, hidden_size]
                expert_out[start : start + count] = self._expert(local, rows)  # [count, hidden_size]
            start += count
        pair_weights = weights.reshape(-1).index_select(0, order).to(hidden.dtype)  # [num_pairs]
        out = torch.zeros_like(hidden)  # [num_tokens, hidden_size]
        out.index_add_(0, token_rows, expert_out * pair_weights[:, None])
        return out

    def _expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert ``expert``'s MLP over ``rows [n, hidden_size]``: ``[n, hidden_size]``; in row tiles
        in the deterministic mode (``row_tile``)."""
        b13 = None if self.w13_bias is None else self.w13_bias[expert]
        b2 = None if self.w2_bias is None else self.w2_bias[expert]

        def mlp(x: torch.Tensor) -> torch.Tensor:
            gate_up = F.linear(x, self.w13[expert], b13)  # [n, 2 * intermediate]
            return F.linear(self.gated(gate_up), self.w2[expert], b2)  # [n, hidden_size]

        return row_tiled(mlp, rows, self.row_tile) if self.row_tile else mlp(rows)


def expert_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name == "silu":
        return F.silu
    if name == "gelu":
        return F.gelu
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"unsupported expert activation {name!r}")


Router = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class SparseMoeBlock(nn.Module):
    """Router + experts (+ an optional shared expert behind a sigmoid gate, as Qwen2-MoE has).

    ``route`` maps router logits ``[num_tokens, num_experts]`` to ``(weights, expert_ids)``; it is
    the model's routing rule (``topk_then_softmax`` or ``softmax_then_topk``). Module names follow
    the checkpoints: ``gate`` (the router), ``experts``, ``shared_expert``, ``shared_expert_gate``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        intermediate_size: int,
        hidden_act: str,
        route: Router,
        dtype: torch.dtype,
        shared_expert: nn.Module | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.gate = LinearBase(hidden_size, num_experts, bias=False, dtype=dtype)  # whole on every rank
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, hidden_act, dtype, tp=tp)
        self.tp = tp
        self.route = route
        self.shared_expert = shared_expert
        self.shared_expert_gate = (
            LinearBase(hidden_size, 1, bias=False, dtype=dtype) if shared_expert is not None else None
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(hidden)  # [num_tokens, num_experts]
        weights, expert_ids = self.route(router_logits)  # [num_tokens, top_k] each
        out = self.tp.all_reduce(self.experts(hidden, weights, expert_ids))  # [num_tokens, hidden_size]
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return out


def load_expert_tensors(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], loaded: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Load the expert tensors of ``weights`` into ``model``'s ``FusedExperts``; yield every other tensor.

    Names are Hugging Face's, relative to ``model`` once a leading ``model.`` is dropped
    (``model.layers.3.mlp.experts.7.gate_proj.weight``, or the stacked ``...mlp.experts.gate_up_proj``). Each loaded name is added to ``loaded``. An expert tensor
    whose layer has no experts raises ValueError (a dense layer in the model, sparse in the file).
    """
    modules = dict(model.named_modules())
    for name, tensor in weights:
        key = name.removeprefix("model.")
        per_expert = _PER_EXPERT.match(key)
        stacked = _STACKED.match(key) if per_expert is None else None
        match = per_expert or stacked
        if match is None:
            yield name, tensor
            continue
        experts = modules.get(match["experts"])
        if not isinstance(experts, FusedExperts):
            raise ValueError(f"checkpoint tensor {name} has no place in this model")
        if per_expert is not None:
            shard = EXPERT_SHARDS.get(per_expert["proj"])
            if shard is None:
                raise ValueError(f"checkpoint tensor {name}: unknown expert projection")
            experts.load_expert(int(per_expert["expert"]), shard, tensor)
        else:
            experts.load_stacked(match["name"], tensor)
        loaded.add(name)
