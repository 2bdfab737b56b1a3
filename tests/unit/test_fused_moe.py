"""The mixture-of-experts layer against a naive per-token reference, routing rules, weight loading."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers.fused_moe import (
    FusedExperts,
    SparseMoeBlock,
    load_expert_tensors,
    softmax_then_topk,
    topk_then_softmax,
)

NUM_EXPERTS, HIDDEN, INTERMEDIATE = 6, 16, 12


def random_experts(seed: int) -> tuple[FusedExperts, list[dict[str, torch.Tensor]]]:
    """A FusedExperts loaded one projection at a time, and the per-expert tensors it was given."""
    generator = torch.Generator().manual_seed(seed)
    experts = FusedExperts(NUM_EXPERTS, HIDDEN, INTERMEDIATE, "silu", torch.float32)
    tensors = []
    for e in range(NUM_EXPERTS):
        shards = {
            "gate": torch.randn(INTERMEDIATE, HIDDEN, generator=generator),
            "up": torch.randn(INTERMEDIATE, HIDDEN, generator=generator),
            "down": torch.randn(HIDDEN, INTERMEDIATE, generator=generator),
        }
        for shard, tensor in shards.items():
            experts.load_expert(e, shard, tensor)
        tensors.append(shards)
    return experts, tensors


def naive_moe(
    hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, tensors: list[dict[str, torch.Tensor]]
) -> torch.Tensor:
    """Token by token, expert by expert: the definition the fused layer must equal."""
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for k in range(ids.shape[1]):
            w = tensors[int(ids[t, k])]
            x = hidden[t]
            out[t] += weights[t, k] * (w["down"] @ (F.silu(w["gate"] @ x) * (w["up"] @ x)))
    return out


@pytest.mark.parametrize("num_tokens,top_k", [(1, 2), (9, 2), (23, 3), (40, 6)])
def test_fused_experts_match_the_per_token_reference(num_tokens: int, top_k: int) -> None:
    experts, tensors = random_experts(seed=num_tokens)
    generator = torch.Generator().manual_seed(100 + num_tokens)
    hidden = torch.randn(num_tokens, HIDDEN, generator=generator)
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=generator)
    weights, ids = softmax_then_topk(logits, top_k, renormalize=False)
    expected = naive_moe(hidden, weights, ids, tensors)
    torch.testing.assert_close(experts(hidden, weights, ids), expected, rtol=1e-5, atol=1e-4)


def test_experts_no_token_chose_stay_idle_and_skewed_routing_works() -> None:
    experts, tensors = random_experts(seed=5)
    generator = torch.Generator().manual_seed(6)  # not the global state: the test's inputs are fixed
    hidden = torch.randn(7, HIDDEN, generator=generator)
    ids = torch.tensor([[4, 1]] * 7)  # every token to experts 4 and 1 only
    weights = torch.rand(7, 2, generator=generator)
    # Unit-variance weights make outputs in the hundreds: float32 sums in another order differ by
    # ~1e-5 relative, so the tolerance is relative to that scale.
    torch.testing.assert_close(
        experts(hidden, weights, ids), naive_moe(hidden, weights, ids, tensors), rtol=1e-5, atol=1e-3
    )


def test_routing_rules() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [0.0, 0.1, -0.2, 0.3]])
    probs = torch.softmax(logits, dim=-1)
    weights, ids = softmax_then_topk(logits, 2, renormalize=False)
    assert ids.tolist() == [[3, 0], [3, 1]]
    torch.testing.assert_close(weights, probs.gather(1, ids))  # not renormalised: sums below 1
    renormed, renormed_ids = softmax_then_topk(logits, 2, renormalize=True)
    assert torch.equal(renormed_ids, ids)
    torch.testing.assert_close(renormed.sum(-1), torch.ones(2))
    mixtral, mixtral_ids = topk_then_softmax(logits, 2)
    assert torch.equal(mixtral_ids, ids)
    torch.testing.assert_close(mixtral, torch.softmax(logits.gather(1, ids), dim=-1))
    torch.testing.assert_close(mixtral, renormed)  # the two rules agree once renormalised


def test_stacked_and_per_expert_loading_agree_and_bad_tensors_are_refused() -> None:
    experts, tensors = random_experts(seed=3)
    stacked = FusedExperts(NUM_EXPERTS, HIDDEN, INTERMEDIATE, "silu", torch.float32)
    gate_up = torch.stack([torch.cat([t["gate"], t["up"]]) for t in tensors])  # [E, 2I, H]
    stacked.load_stacked("gate_up_proj", gate_up)
    stacked.load_stacked("down_proj", torch.stack([t["down"] for t in tensors]))
    assert torch.equal(stacked.w13, experts.w13) and torch.equal(stacked.w2, experts.w2)
    with pytest.raises(ValueError, match="expert 6 out of range"):
        experts.load_expert(6, "gate", tensors[0]["gate"])
    with pytest.raises(ValueError, match="does not fit"):
        experts.load_expert(0, "down", tensors[0]["gate"])
    with pytest.raises(ValueError, match="does not fit"):
        stacked.load_stacked("gate_up_proj", gate_up[:, :INTERMEDIATE])


def test_load_expert_tensors_routes_by_name() -> None:
    route = functools.partial(topk_then_softmax, top_k=2)
    block = torch.nn.ModuleDict(
        {"mlp": SparseMoeBlock(HIDDEN, NUM_EXPERTS, INTERMEDIATE, "silu", route, torch.float32)}
    )
    gate = torch.randn(INTERMEDIATE, HIDDEN)
    weights = [
        ("model.mlp.experts.2.gate_proj.weight", gate),
        ("model.mlp.gate.weight", torch.randn(NUM_EXPERTS, HIDDEN)),
    ]
    loaded: set[str] = set()
    rest = list(load_expert_tensors(block, weights, loaded))
    assert [name for name, _ in rest] == ["model.mlp.gate.weight"]
    assert loaded == {"model.mlp.experts.2.gate_proj.weight"}
    assert torch.equal(block["mlp"].experts.w13[2, :INTERMEDIATE], gate)
    with pytest.raises(ValueError, match="has no place"):
        list(load_expert_tensors(block, [("model.attn.experts.0.w1.weight", gate)], set()))
