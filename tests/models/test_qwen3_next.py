"""Qwen3-Next (Gated DeltaNet + gated full attention + MoE) against transformers, with its state pool.

A tiny random float32 config (three linear-attention layers and one full-attention layer, a dense
layer and sparse ones with a shared expert) must give transformers' greedy tokens (its torch fallback
of the gated delta rule and the causal convolution is the reference) through the whole engine:
several concurrent prompts of different lengths, prompts split over many chunked-prefill steps,
``n = 2`` siblings resuming from their leader's state snapshot, preemption (state dropped and
recomputed), and prefix-cache hits that restore a snapshot (including the next turn of a chat, which
resumes at the previous turn's output). State slots and snapshots must all come back.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TinyModel, TinySpec, save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.core.kv.hybrid import HybridKVCacheManager
from tokenmill.layers import recurrent_kernel

SPEC = TinySpec(
    "qwen3_next",
    "Qwen3NextConfig",
    {
        "num_hidden_layers": 4,  # linear, linear, linear, full
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "mlp_only_layers": [1],
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    },
)
NUM_NEW = 10
LENGTHS = [5, 37, 80, 13, 22]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    folder = str(tmp_path_factory.mktemp("tiny-qwen3-next"))
    hf = save_tiny_model(SPEC, seed=43, folder=folder)
    hf.generation_config.eos_token_id = None
    return TinyModel(arch="qwen3_next", path=folder, hf=hf)


def prompts(lengths: list[int] = LENGTHS, salt: int = 0) -> list[list[int]]:
    return [[(7 * i + 3 * j + salt) % 150 + 5 for j in range(n)] for i, n in enumerate(lengths)]


def greedy(max_tokens: int = NUM_NEW, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


def run(llm: LLM, token_prompts: list[list[int]], params: SamplingParams | None = None) -> list[list[int]]:
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in token_prompts], params or greedy(), use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in outputs]


def make_llm(model: TinyModel, **kwargs: object) -> LLM:
    options: dict[str, object] = {
        "dtype": "float32",
        "block_size": 4,
        "num_blocks": 256,
        "max_num_batched_tokens": 64,
    }
    options.update(kwargs)
    return LLM(model.path, **options)


def manager(llm: LLM) -> HybridKVCacheManager:
    kv = llm.engine.kv_manager
    assert isinstance(kv, HybridKVCacheManager)
    return kv


def test_concurrent_prompts_and_chunked_prefill_match_transformers(model: TinyModel) -> None:
    batch = prompts()
    expected = [model.greedy(p, NUM_NEW) for p in batch]
    # Chunks of 16 tokens: the 80-token prompt takes five steps, carrying its state across them.
    llm = make_llm(model, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert run(llm, batch) == expected
    kv = manager(llm)
    assert kv.states.num_free == kv.states.num_slots  # every slot back, no snapshot without a cache
    assert llm.engine.executor.runner.model.num_layers == 1  # the KV pool serves the full-attention layer


@pytest.mark.parametrize("prefix_caching", [True, False])
def kernel_calls(monkeypatch: pytest.MonkeyPatch, kernels: str) -> list[str]:
    """Sets ``TOKENMILL_RECURRENT_KERNELS`` to ``kernels`` and records each recurrent kernel call."""
    monkeypatch.setenv("TOKENMILL_RECURRENT_KERNELS", kernels)
    calls: list[str] = []
    original = recurrent_kernel._ops

    def counting(library: str):  # type: ignore[no-untyped-def]
        calls.append(library)
        return original(library)

    monkeypatch.setattr(recurrent_kernel, "_ops", counting)
    return calls


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_the_cpu_kernels_and_the_torch_reference_both_match(
    model: TinyModel, kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = kernel_calls(monkeypatch, kernels)
    batch = prompts([37, 13], salt=1)
    llm = make_llm(model, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert run(llm, batch) == [model.greedy(p, NUM_NEW) for p in batch]
    assert bool(calls) == (kernels == "1")  # the kernels ran exactly when switched on


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_siblings_resume_from_the_leaders_snapshot(model: TinyModel, prefix_caching: bool) -> None:
    llm = make_llm(model, enable_prefix_caching=prefix_caching)
    kv = manager(llm)
    shared: list[int] = []
    original = kv.share_prefix

    def spy(source_id: str, request, num_tokens: int, count_as_hit: bool = False) -> int:  # type: ignore[no-untyped-def]
        shared.append(original(source_id, request, num_tokens, count_as_hit))
        return shared[-1]

    kv.share_prefix = spy  # type: ignore[method-assign]
    prompt = prompts([30])[0]
    outputs = llm.generate([{"prompt_token_ids": prompt}], greedy(n=2), use_tqdm=False)
    expected = model.greedy(prompt, NUM_NEW)
    assert [list(c.token_ids) for c in outputs[0].outputs] == [expected, expected]
    assert shared == [28]  # the sibling took the 28 tokens of whole blocks and the state after them


def test_preemption_drops_state_and_recomputes(model: TinyModel) -> None:
    batch = prompts([30, 26, 33, 28], salt=3)
    expected = [model.greedy(p, NUM_NEW) for p in batch]
    llm = make_llm(model, num_blocks=24, enable_prefix_caching=False, max_num_batched_tokens=32)
    assert run(llm, batch) == expected
    assert llm.engine.scheduler.num_preemptions_total > 0


def test_preemption_keeps_state_when_it_fits(model: TinyModel) -> None:
    batch = prompts([30, 26, 33, 28], salt=3)
    expected = [model.greedy(p, NUM_NEW) for p in batch]
    # Chunks of 16 tokens: a prompt is preempted at a block boundary between its chunks.
    llm = make_llm(model, num_blocks=24, enable_prefix_caching=True, max_num_batched_tokens=16)
    assert run(llm, batch) == expected
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert manager(llm).num_preempted_states_kept > 0  # resumed from its own state, kept as a snapshot


def test_prefix_hit_restores_a_snapshot(model: TinyModel) -> None:
    base = prompts([41], salt=5)[0]
    llm = make_llm(model, state_checkpoint_interval=8)
    kv = manager(llm)
    assert run(llm, [base]) == [model.greedy(base, NUM_NEW)]
    assert kv.stats()["state_snapshots"] > 0
    # A longer prompt over the same start resumes from the deepest snapshot on the cached path.
    longer = base + [9, 8, 7, 6, 5, 4, 3]
    before = kv.prefix_hit_tokens
    assert run(llm, [longer]) == [model.greedy(longer, NUM_NEW)]
    assert kv.prefix_hit_tokens - before == 40  # the prompt-end snapshot at 40 tokens (whole blocks)


def test_next_chat_turn_resumes_at_the_previous_output(model: TinyModel) -> None:
    first = prompts([23], salt=11)[0]
    llm = make_llm(model)
    kv = manager(llm)
    reply = run(llm, [first], greedy(12))[0]
    assert reply == model.greedy(first, 12)
    second = first + reply + [17, 18, 19, 20, 21]
    before = kv.prefix_hit_tokens
    assert run(llm, [second]) == [model.greedy(second, NUM_NEW)]
    # 23 prompt + 11 computed output tokens: the snapshot at the last block boundary, 32.
    assert kv.prefix_hit_tokens - before == 32


def test_snapshots_are_evicted_and_their_slots_freed(model: TinyModel) -> None:
    # Two slots for the running request (max_num_seqs=2), two for snapshots.
    llm = make_llm(model, num_state_slots=4, max_num_seqs=2, state_checkpoint_interval=8)
    kv = manager(llm)
    batch = prompts([40, 40, 40], salt=21)
    for prompt in batch:
        assert run(llm, [prompt]) == [model.greedy(prompt, NUM_NEW)]
        kv.check_integrity()
        assert kv.stats()["state_snapshots"] <= 2
    stats = kv.stats()
    assert stats["state_snapshot_bytes"] == stats["state_snapshots"] * stats["state_slot_bytes"] > 0
    assert llm.reset_prefix_cache()
    assert kv.stats()["state_snapshots"] == 0 and kv.states.num_free == 4


def test_aborts_leak_nothing(model: TinyModel) -> None:
    llm = make_llm(model, max_num_batched_tokens=16)
    kv = manager(llm)
    engine = llm.engine
    from tokenmill.protocol import EngineCoreRequest

    for i, prompt in enumerate(prompts([50, 20, 35], salt=7)):
        engine.add_request(
            EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=greedy())
        )
    for _ in range(3):
        engine.step()
    engine.abort_requests(["r0", "r1", "r2"])
    kv.check_integrity()
    assert kv.all_free_or_cached()
    assert kv.states.num_used == kv.stats()["state_snapshots"]


@pytest.mark.parametrize(
    ("options", "feature"),
    [
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative decoding"),
        ({"deterministic": True}, "the deterministic mode"),
        ({"enable_lora": True}, "LoRA"),
    ],
)
def test_unsupported_combinations_are_refused(
    model: TinyModel, options: dict[str, object], feature: str
) -> None:
    with pytest.raises(ValueError, match=f"{feature} with recurrent-state models is not supported yet"):
        make_llm(model, **options)


def test_state_layout_matches_the_config(model: TinyModel) -> None:
    llm = make_llm(model, enable_prefix_caching=False)
    runner = llm.engine.executor.runner
    layout = runner.model.recurrent_state_layout()
    assert len(layout) == 3
    assert layout[0] == [((2 * 32 + 64, 3), torch.float32), ((4, 16, 16), torch.float32)]


def drive(llm: LLM, requests: list[object]) -> dict[str, list[int]]:
    """Add engine requests directly and step until all finish; returns each request's tokens."""
    engine = llm.engine
    for request in requests:
        engine.add_request(request)  # type: ignore[arg-type]
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return tokens


def test_service_tiers_compose(model: TinyModel) -> None:
    from tokenmill.protocol import EngineCoreRequest

    batch = prompts([45, 12, 30], salt=13)
    tiers = ["flex", "priority", "default"]
    llm = make_llm(model, max_num_batched_tokens=16)
    requests = [
        EngineCoreRequest(request_id=f"t{i}", prompt_token_ids=p, sampling_params=greedy(), service_tier=tier)
        for i, (p, tier) in enumerate(zip(batch, tiers))
    ]
    tokens = drive(llm, requests)
    assert [tokens[f"t{i}"] for i in range(3)] == [model.greedy(p, NUM_NEW) for p in batch]


def test_structured_output_composes(model: TinyModel) -> None:
    from tokenmill.sampling_params import StructuredOutputsParams

    prompt = prompts([19], salt=17)[0]
    llm = make_llm(model)
    params = greedy(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["w20", "w30"]))
    params.ignore_eos = False
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        logits = model.hf(torch.tensor([prompt])).logits[0, -1]
    expected = 20 if logits[20] > logits[30] else 30
    assert list(out.token_ids)[0] == expected
    assert out.text.strip() == f"w{expected}"


@pytest.mark.parametrize(
    ("config_cls", "dropped", "hf_class"),
    [
        ("Qwen3_5TextConfig", ("num_experts", "moe_", "shared_", "mlp_only"), "Qwen3_5ForCausalLM"),
        ("Qwen3_5MoeTextConfig", ("mlp_only", "intermediate"), "Qwen3_5MoeForCausalLM"),
    ],
)
def test_qwen3_5_text_models_match_transformers(
    tmp_path_factory: pytest.TempPathFactory, config_cls: str, dropped: tuple[str, ...], hf_class: str
) -> None:
    spec = TinySpec(
        "qwen3_5", config_cls, {k: v for k, v in SPEC.kwargs.items() if not k.startswith(dropped)}
    )
    folder = str(tmp_path_factory.mktemp("tiny-qwen3-5"))
    hf = save_tiny_model(spec, seed=44, folder=folder)
    hf.generation_config.eos_token_id = None
    qwen35 = TinyModel(arch="qwen3_5", path=folder, hf=hf)
    batch = prompts([7, 45, 20], salt=9)
    llm = make_llm(qwen35, max_num_batched_tokens=16)
    assert run(llm, batch) == [qwen35.greedy(p, NUM_NEW) for p in batch]
    assert type(hf).__name__ == hf_class
    from tokenmill.layers.fused_moe import SparseMoeBlock

    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in llm.engine.executor.runner.model.layers]
    assert sparse == [hf_class == "Qwen3_5MoeForCausalLM"] * 4


def test_a_step_stops_only_before_its_first_layer(model: TinyModel, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A pausable step stopped before layer 0 (the flag already raised) pauses and goes on after the
    arrivals' pass; a flag raised once a layer has updated its states is not obeyed (the step
    could not be redone), so the step ends normally. Every token still equals transformers'."""
    from tokenmill.protocol import EngineCoreRequest
    from tokenmill.step_control import InterruptFlag

    llm = make_llm(model, short_prefill_interrupt=8)
    core = llm.engine
    flag = InterruptFlag.create(str(tmp_path))
    core.set_interrupt(flag)
    first, arrival = prompts([13], salt=30)[0], prompts([5], salt=40)[0]
    tokens: dict[str, list[int]] = {"a": [], "b": []}

    def step() -> None:
        for output in core.step().outputs:
            tokens[output.request_id].extend(output.new_token_ids)

    core.add_request(EngineCoreRequest(request_id="a", prompt_token_ids=first, sampling_params=greedy(6)))
    step()  # a's prompt
    net = core.executor.runner.model
    whole = net.forward

    def arrival_first(*args, **kwargs):  # type: ignore[no-untyped-def]
        flag.raise_()  # as an arrival would, before the pass reaches layer 0
        net.forward = whole
        return whole(*args, **kwargs)

    net.forward = arrival_first
    step()  # a's first decode stops before its first layer
    assert core.num_paused_steps == 1 and tokens["a"] == [model.greedy(first, 1)[0]]
    flag.clear()
    core.add_request(EngineCoreRequest(request_id="b", prompt_token_ids=arrival, sampling_params=greedy(4)))
    linear = core.executor.runner.model.layers[0].linear_attn
    forward = linear.forward

    def raising(*args, **kwargs):  # type: ignore[no-untyped-def]
        flag.raise_()
        return forward(*args, **kwargs)

    linear.forward = raising
    while core.has_unfinished_requests():
        step()
        flag.clear()
    assert core.num_paused_steps == 1  # raised mid-pass every step, never obeyed
    assert tokens == {"a": model.greedy(first, 6), "b": model.greedy(arrival, 4)}
