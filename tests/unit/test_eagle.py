"""EAGLE-1 and EAGLE-3 heads (``models/eagle.py``, ``worker/eagle_proposer.py``) on a tiny random
4-layer Llama with randomly initialised heads saved in the published layouts (EAGLE-1 as a ``.bin``,
EAGLE-3 as safetensors with a reduced draft vocabulary): greedy output token for token that of
transformers, seeded sampling what it is without speculation, the head's blocks all back in its pool
after rejected drafts and aborts, EAGLE-3's features the target layers' inputs, and heads that do
not fit the target are clear errors.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import TinyModel, TinySpec, save_tiny_model
from tokenmill import LLM, SamplingParams

K = 3
NUM_NEW = 12
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = 64, 4, 2, 16, 128, 160, 4
PROMPTS = [[5, 9, 33, 71, 12, 40, 40, 7], [100, 101, 102, 103, 100, 101], [17, 18]]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    folder = str(tmp_path_factory.mktemp("tiny-llama-4-layers"))
    spec = TinySpec(
        "llama",
        "LlamaConfig",
        {"num_key_value_heads": KV_HEADS, "tie_word_embeddings": False, "num_hidden_layers": LAYERS},
    )
    hf = save_tiny_model(spec, seed=11, folder=folder)
    return TinyModel(arch="llama-4", path=folder, hf=hf)


def head_config(**overrides: object) -> dict[str, object]:
    config: dict[str, object] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
    }
    config.update(overrides)
    return config


def attention_and_mlp(prefix: str, attention_in: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) / shape[-1] ** 0.5

    return {
        f"{prefix}.self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, attention_in),
        f"{prefix}.self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, attention_in),
        f"{prefix}.self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, attention_in),
        f"{prefix}.self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
        f"{prefix}.post_attention_layernorm.weight": 1 + 0.1 * torch.randn(HIDDEN, generator=generator),
        f"{prefix}.mlp.gate_proj.weight": rand(FFN, HIDDEN),
        f"{prefix}.mlp.up_proj.weight": rand(FFN, HIDDEN),
        f"{prefix}.mlp.down_proj.weight": rand(HIDDEN, FFN),
    }


def save_eagle1(folder: str, hidden: int = HIDDEN) -> str:
    """A random EAGLE-1 head: ``fc`` (with bias) over [embed; hidden], ``layers.0`` without an input
    norm, the embedding copied in, saved as ``pytorch_model.bin``."""
    generator = torch.Generator().manual_seed(1)
    tensors = attention_and_mlp("layers.0", HIDDEN, generator)
    tensors["fc.weight"] = torch.randn(HIDDEN, 2 * hidden, generator=generator) / (2 * hidden) ** 0.5
    tensors["fc.bias"] = 0.1 * torch.randn(HIDDEN, generator=generator)
    tensors["embed_tokens.weight"] = torch.randn(VOCAB, HIDDEN, generator=generator)
    os.makedirs(folder, exist_ok=True)
    torch.save(tensors, os.path.join(folder, "pytorch_model.bin"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(head_config(), f)
    return folder


DRAFT_VOCAB = 48


def save_eagle3(folder: str, vocab: int = VOCAB) -> str:
    """A random EAGLE-3 head: ``fc`` over three layers' features, ``midlayer`` attending over
    [embed; hidden] (2H), its own norm and LM head over a draft vocabulary of ``DRAFT_VOCAB`` ids
    mapped by ``d2t``, saved as safetensors."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(2)
    tensors = attention_and_mlp("midlayer", 2 * HIDDEN, generator)
    tensors["midlayer.input_layernorm.weight"] = 1 + 0.1 * torch.randn(HIDDEN, generator=generator)
    tensors["midlayer.hidden_norm.weight"] = 1 + 0.1 * torch.randn(HIDDEN, generator=generator)
    tensors["fc.weight"] = torch.randn(HIDDEN, 3 * HIDDEN, generator=generator) / (3 * HIDDEN) ** 0.5
    tensors["norm.weight"] = torch.ones(HIDDEN)
    tensors["lm_head.weight"] = torch.randn(DRAFT_VOCAB, HIDDEN, generator=generator)
    draft_ids = torch.arange(5, 5 + 2 * DRAFT_VOCAB, 2)  # every other word: target id of draft id i
    tensors["d2t"] = draft_ids - torch.arange(DRAFT_VOCAB)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d
    os.makedirs(folder, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(
            head_config(
                architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_VOCAB, vocab_size=vocab
            ),
            f,
        )
    return folder


@pytest.fixture(scope="module")
def heads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("eagle-heads")
    return {"eagle": save_eagle1(str(root / "eagle1")), "eagle3": save_eagle3(str(root / "eagle3"))}


def make_llm(target: TinyModel, spec: dict[str, object] | None, **kwargs: object) -> LLM:
    options: dict[str, object] = {"dtype": "float32", "block_size": 4, "num_blocks": 96, "seed": 0}
    options.update(kwargs)
    return LLM(target.path, speculative_config=spec, **options)


def generate(llm: LLM, params: SamplingParams) -> list[list[list[int]]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


def spec_of(method: str, folder: str) -> dict[str, object]:
    return {"method": method, "model": folder, "num_speculative_tokens": K, "draft_confidence": 0.0}


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_greedy_and_seeded_outputs_are_those_without_speculation(
    target: TinyModel, heads: dict[str, str], method: str
) -> None:
    from tokenmill.worker.eagle_proposer import EagleProposer

    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=NUM_NEW, ignore_eos=True)
    plain = make_llm(target, None)
    want_seeded = generate(plain, seeded)
    llm = make_llm(target, spec_of(method, heads[method]), max_num_batched_tokens=16)
    got = generate(llm, greedy)
    assert [o[0] for o in got] == [target.greedy(p, NUM_NEW) for p in PROMPTS]
    assert generate(llm, seeded) == want_seeded
    stats = llm.engine.kv_stats()
    assert stats["spec_num_draft_tokens"] > 0, stats
    proposer = llm.engine.executor.runner.proposer  # type: ignore[attr-defined]
    assert isinstance(proposer, EagleProposer)
    llm.engine.executor.execute(llm.engine.scheduler.schedule())  # tells the worker who finished
    assert sorted(proposer.free_blocks) == list(range(proposer.blocks.num_blocks))
    llm.engine.kv_manager.check_integrity()


def test_an_abort_mid_draft_gives_the_heads_blocks_back(target: TinyModel, heads: dict[str, str]) -> None:
    from tokenmill.protocol import EngineCoreRequest

    llm = make_llm(target, spec_of("eagle3", heads["eagle3"]))
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(
            EngineCoreRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params)
        )
    drafted = 0
    while drafted < 3:
        engine.step()
        drafted += sum(1 for r in engine.scheduler.running if r.draft_token_ids)
    proposer = engine.executor.runner.proposer  # type: ignore[attr-defined]
    assert len(proposer.free_blocks) < proposer.blocks.num_blocks  # drafting holds blocks
    assert engine.abort_requests([str(i) for i in range(len(PROMPTS))])
    while engine.has_unfinished_requests():
        engine.step()
    engine.executor.execute(engine.scheduler.schedule())  # tells the worker who finished
    assert sorted(proposer.free_blocks) == list(range(proposer.blocks.num_blocks))
    engine.kv_manager.check_integrity()
    assert engine.kv_manager.all_free_or_cached()


def test_eagle3_reads_the_target_layers_inputs(target: TinyModel, heads: dict[str, str], monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The features the head reads at its first step are transformers' inputs of layers 1, 2, 2
    (``2, N // 2, N - 3`` sorted for 4 layers), concatenated, from a prompt prefilled in chunks."""
    from tokenmill.worker.eagle_proposer import EagleProposer

    seen: list[torch.Tensor] = []
    original = EagleProposer._run

    def spy(self, steps, previous):  # type: ignore[no-untyped-def]
        seen.append(previous.clone())
        return original(self, steps, previous)

    monkeypatch.setattr(EagleProposer, "_run", spy)
    prompt = PROMPTS[0] * 3
    llm = make_llm(
        target, spec_of("eagle3", heads["eagle3"]), max_num_batched_tokens=8, enable_prefix_caching=False
    )
    llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False
    )
    with torch.no_grad():
        states = target.hf.model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    expected = torch.cat(
        [states[1][0], states[2][0], states[2][0]], dim=-1
    )  # [24, 3H]: every prompt position
    torch.testing.assert_close(seen[0], expected, atol=1e-4, rtol=1e-4)


def test_heads_that_do_not_fit_are_clear_errors(target: TinyModel, heads: dict[str, str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="holds an eagle3 head"):
        make_llm(target, spec_of("eagle", heads["eagle3"]))
    with pytest.raises(ValueError, match="vocabulary has 161 tokens, the target's 160"):
        make_llm(target, spec_of("eagle3", save_eagle3(str(tmp_path / "other-vocab"), vocab=161)))
    wrong = save_eagle1(str(tmp_path / "wrong-hidden"))
    with open(os.path.join(wrong, "config.json"), "w") as f:
        json.dump(head_config(hidden_size=32), f)
    with pytest.raises(ValueError, match="hidden size is 32, the target's 64"):
        make_llm(target, spec_of("eagle", wrong))
    with pytest.raises(ValueError, match="has no config.json"):
        make_llm(target, spec_of("eagle", str(tmp_path)))


def test_a_head_trained_here_loads_as_eagle_and_keeps_greedy_outputs(target: TinyModel, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``tokenmill train-eagle``'s pieces on the tiny model: the target's own answers with their
    hidden states, a few seconds of training, the head saved with a reduced draft vocabulary; the
    engine loads it as ``eagle`` and greedy output stays transformers'."""
    import time

    from tokenmill.loader import resolve_model
    from tokenmill.train.eagle import TrainEagleOptions, _cached_samples, save_head, train_head

    out = str(tmp_path / "trained")
    options = TrainEagleOptions(model=target.path, out=out, answer_tokens=16, draft_vocab=64, batch_size=4)
    samples = _cached_samples(options, PROMPTS * 2)
    assert len(samples) == 2 * len(PROMPTS)
    again = _cached_samples(options, PROMPTS * 2)  # read back from out/samples.pt
    assert [s.tokens for s in again] == [s.tokens for s in samples]
    torch.testing.assert_close(again[0].features, samples[0].features, atol=0.1, rtol=0.02)  # bf16 kept
    first = samples[0]
    assert first.features.shape == (len(first.tokens), HIDDEN)
    answer = first.tokens[first.answer_start :]  # the answer but its last token (never fed back)
    assert answer and target.greedy(PROMPTS[0], 16)[: len(answer)] == answer
    source = resolve_model(target.path)
    head, d2t, steps = train_head(options, source, samples, time.monotonic() + 3.0)
    assert steps > 0
    assert d2t.shape == (64,)
    save_head(head, d2t, source.hf_config, out)
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    llm = make_llm(target, spec_of("eagle", out))
    assert [o[0] for o in generate(llm, greedy)] == [target.greedy(p, NUM_NEW) for p in PROMPTS]
    assert llm.engine.kv_stats()["spec_num_draft_tokens"] > 0


def test_answering_stops_at_its_deadline_after_whole_chunks(target: TinyModel, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``generate_samples`` answers in chunks of ``GENERATE_CHUNK`` prompts and starts none once the
    deadline has passed: the answers it has are the first chunks', in prompt order, each the target's
    greedy answer. No answer at all is an error, and nothing is cached for a rerun."""
    import types

    from tokenmill.train import eagle

    monkeypatch.setattr(eagle, "GENERATE_CHUNK", 2)
    readings = iter([0.0, 10.0, 20.0])  # one reading before each chunk
    monkeypatch.setattr(eagle, "time", types.SimpleNamespace(monotonic=lambda: next(readings)))
    options = eagle.TrainEagleOptions(model=target.path, out="unused", answer_tokens=4)
    prompts = PROMPTS + [[3, 4, 5], [6, 7]]  # five prompts: chunks of 2, 2 and 1
    samples = eagle.generate_samples(options, prompts, deadline=15.0)
    assert [s.tokens[: s.answer_start] for s in samples] == prompts[:4]  # two chunks, not the third
    for prompt, sample in zip(prompts, samples):
        answer = sample.tokens[sample.answer_start :]  # its last token was never fed back
        assert answer and target.greedy(prompt, 4)[: len(answer)] == answer
    monkeypatch.setattr(eagle, "time", types.SimpleNamespace(monotonic=lambda: 100.0))
    assert eagle.generate_samples(options, prompts, deadline=15.0) == []  # past it before the first
    cached = eagle.TrainEagleOptions(model=target.path, out=str(tmp_path), answer_tokens=4)
    with pytest.raises(ValueError, match="no prompt was answered within the answering share"):
        eagle._cached_samples(cached, prompts, deadline=15.0)
    assert not os.path.exists(tmp_path / "samples.pt")


def test_a_budget_with_no_time_to_train_is_a_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tokenmill.train.eagle import TrainEagleOptions, train_eagle

    options = TrainEagleOptions(model="smollm2-135m", out=str(tmp_path), max_minutes=2)
    with pytest.raises(
        ValueError, match="--max-minutes 2 leaves no time to answer prompts and train: 2 minutes"
    ):
        train_eagle(options)


def test_a_trained_head_drafts_at_serving_what_it_computed_in_training(target: TinyModel, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Training and serving agree: the features ``_FeatureRecorder`` keeps for a prompt are the rows
    the ``eagle`` proposer reads for the same positions (the target's final, normed hidden states),
    and a random ``TrainHead`` saved by ``save_head`` and loaded by ``models/eagle.py`` gives, fed
    position by position through the proposer's KV cache, the hidden states and draft logits that
    ``TrainHead.forward`` + its ``lm_head`` give over the whole sequence (same ``[embed; features]``
    order, rotary positions, embedding and ``d2t`` direction)."""
    from tests.conftest import spread_weights
    from tokenmill.loader import resolve_model
    from tokenmill.train.eagle import (
        TrainEagleOptions,
        TrainHead,
        _target_tensors,
        generate_samples,
        save_head,
    )
    from tokenmill.worker.eagle_proposer import EagleProposer

    source = resolve_model(target.path)
    config = source.hf_config
    head = TrainHead(type(config).from_dict({**config.to_dict(), "num_hidden_layers": 1}), DRAFT_VOCAB)
    spread_weights(head, seed=5)
    draft_ids = torch.arange(7, 7 + 3 * DRAFT_VOCAB, 3)  # target id of draft id i
    out = str(tmp_path / "head")
    save_head(head, draft_ids - torch.arange(DRAFT_VOCAB), config, out)

    prompt = PROMPTS[0] * 2
    options = TrainEagleOptions(model=target.path, out=out, answer_tokens=4, dtype="float32")
    recorded = generate_samples(options, [prompt])[0].features  # [len(prompt) + 3, H]
    seen: list[torch.Tensor] = []
    original = EagleProposer._run

    def spy(self, steps, previous):  # type: ignore[no-untyped-def]
        seen.append(previous.clone())
        return original(self, steps, previous)

    spy_patch = pytest.MonkeyPatch()
    spy_patch.setattr(EagleProposer, "_run", spy)
    llm = make_llm(target, spec_of("eagle", out), enable_prefix_caching=False)
    llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False
    )
    spy_patch.undo()
    with torch.no_grad():  # the final hidden state after the model's norm
        normed = target.hf.model(torch.tensor([prompt])).last_hidden_state[0]  # [L, H]
    torch.testing.assert_close(recorded[: len(prompt)], normed, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(seen[0], normed, atol=1e-4, rtol=1e-4)

    proposer = llm.engine.executor.runner.proposer  # type: ignore[attr-defined]
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(len(prompt), HIDDEN, generator=generator)  # [L, H]
    tokens = torch.randint(0, VOCAB, (len(prompt),), generator=generator)  # t_{p+1} of row p
    embed, _ = _target_tensors(source)
    with torch.no_grad():
        want_hidden = head(features[None], torch.nn.functional.embedding(tokens, embed)[None])[0]
        want_logits = head.lm_head(want_hidden)  # [L, DRAFT_VOCAB]
    table = list(range(len(prompt) // 4 + 1))
    rows = [proposer._run([(p, table, [int(tokens[p])])], features[p : p + 1]) for p in range(len(prompt))]
    got_hidden = torch.cat([h for h, _ in rows])
    got_logits = torch.cat([logits for _, logits in rows])
    torch.testing.assert_close(got_hidden, want_hidden, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-3, rtol=1e-3)
    drafts = proposer._confident(got_logits)
    assert drafts == draft_ids[want_logits.argmax(-1)].tolist()


def test_a_bfloat16_head_drafts_with_int4_weights_unless_told_otherwise(
    target: TinyModel, heads: dict[str, str]
) -> None:
    """On CPU in bfloat16 the head's linear layers take int4 copies by default (its draft steps read
    a quarter of the bytes); ``quantization: none`` keeps its weights. Either way greedy output is the
    engine's own without speculation: a drafter's weights change acceptance, never tokens."""
    from tokenmill.layers.linear import LinearBase

    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    want = generate(make_llm(target, None, dtype="bfloat16"), greedy)
    for quantization, int4 in ((None, True), ("none", False)):
        spec = {**spec_of("eagle", heads["eagle"]), "quantization": quantization, "adaptive": False}
        llm = make_llm(target, spec, dtype="bfloat16")
        head = llm.engine.executor.runner.proposer.head_module  # type: ignore[attr-defined]
        linears = [m for m in head.modules() if isinstance(m, LinearBase)]
        assert linears and all((m.int4_weight is not None) == int4 for m in linears), quantization
        assert generate(llm, greedy) == want
        assert llm.engine.kv_stats()["spec_num_accepted_tokens"] > 0


def test_drafter_quantization_is_refused_where_it_cannot_apply(
    target: TinyModel, heads: dict[str, str]
) -> None:
    with pytest.raises(ValueError, match='"quantization" is for the drafter\'s weights'):
        make_llm(target, {"method": "ngram", "quantization": "int4"})
    with pytest.raises(ValueError, match="quantization 'int4' needs dtype bfloat16 on CPU"):
        make_llm(target, {**spec_of("eagle", heads["eagle"]), "quantization": "int4"})  # float32
    with pytest.raises(ValueError, match="quantization 'int8' needs dtype bfloat16 on CPU"):
        make_llm(target, {"method": "draft_model", "model": target.path, "quantization": "int8"})
