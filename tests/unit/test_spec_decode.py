"""Speculative decoding through the whole engine on the tiny random Llama (``core/spec_decode.py``,
``spec/``, ``sample/rejection.py``): greedy output token for token what it is without speculation
(and what transformers gives), with drafts accepted and rejected at every position; the KV cache
clean after rejected drafts, aborts mid-draft and preemption; stops and ``max_tokens`` cut a draft
run where plain decoding stops; logprobs are the target's; seeded sampling reproducible; the
unsupported combinations are clear errors.

An oracle proposer (the reference continuation, with one draft made wrong at a position that cycles
through all of them) makes acceptance deterministic; the real n-gram proposer runs on repetitive
prompts.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from tests.conftest import TinyModel, word
from tokenmill import LLM, SamplingParams
from tokenmill.config import SpeculativeConfig, build_engine_config
from tokenmill.core.kv.manager import cdiv
from tokenmill.core.spec_decode import EXPLORE_STEPS, SpecDecodeState
from tokenmill.core.step_time import StepTimeModel
from tokenmill.protocol import EngineCoreRequest
from tokenmill.spec.proposer import DraftContext

K = 4
NUM_NEW = 24
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def model(tiny_model) -> TinyModel:  # type: ignore[no-untyped-def]
    return tiny_model("llama")


def make_prompts() -> list[list[int]]:
    rng = random.Random(7)
    motif = [rng.randrange(5, 160) for _ in range(10)]
    return [motif * 3, [rng.randrange(5, 160) for _ in range(17)], motif + motif[:4], [9, 8, 7]]


PROMPTS = make_prompts()


def make_llm(model: TinyModel, speculative: dict[str, object] | None = SPEC, **kwargs: object) -> LLM:
    options: dict[str, object] = {"dtype": "float32", "block_size": 4, "num_blocks": 192, "seed": 0}
    options.update(kwargs)
    return LLM(model.path, speculative_config=speculative, **options)


def greedy(max_tokens: int = NUM_NEW, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):  # type: ignore[no-untyped-def]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def token_ids(outputs) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [o.outputs[0].token_ids for o in outputs]


class OracleProposer:
    """Drafts ``K`` tokens of each prompt's known continuation; at its ``i``-th proposal the draft at
    position ``i % (K + 1)`` is made wrong (none when that is ``K``), so every position is rejected
    in turn and whole runs are accepted too."""

    def __init__(self, continuations: list[tuple[list[int], list[int]]], vocab: int = 160) -> None:
        self.continuations = continuations
        self.vocab = vocab
        self.num_proposals = 0

    def propose(self, contexts: list[DraftContext]) -> dict[str, list[int]]:
        drafts = {}
        for context in contexts:
            for prompt, continuation in self.continuations:
                done = len(context.token_ids) - len(prompt)
                if context.token_ids == [*prompt, *continuation[:done]]:
                    draft = list(continuation[done : done + context.max_drafts])
                    wrong = self.num_proposals % (K + 1)
                    if wrong < len(draft):
                        draft[wrong] = 5 + (draft[wrong] + 1 - 5) % (self.vocab - 5)
                    self.num_proposals += 1
                    if draft:
                        drafts[context.request_id] = draft
                    break
        return drafts

    def drop(self, request_ids: list[str]) -> None:
        pass


def use_oracle(llm: LLM, continuations: list[tuple[list[int], list[int]]]) -> OracleProposer:
    oracle = OracleProposer(continuations)
    llm.engine.executor.runner.proposer = oracle  # type: ignore[attr-defined]
    return oracle


def check_blocks_every_step(llm: LLM) -> Callable[[], int]:
    """After every engine step: the pool's integrity, and no running request holding a block past
    its tokens (rejected drafts' slots were given back). Returns a counter of steps checked."""
    engine = llm.engine
    step = engine.step
    steps = [0]

    def checked():  # type: ignore[no-untyped-def]
        outputs = step()
        kv = engine.kv_manager
        kv.check_integrity()
        for request in engine.scheduler.running:
            assert kv.num_held_blocks(request.request_id) <= cdiv(request.num_tokens, kv.block_size)
        steps[0] += 1
        return outputs

    engine.step = checked  # type: ignore[method-assign]
    return lambda: steps[0]


# ---------------------------------------------------------------- greedy identity


def test_greedy_output_is_identical_with_drafts_accepted_and_rejected_at_every_position(
    model: TinyModel,
) -> None:
    expected = [model.greedy(p, NUM_NEW) for p in PROMPTS]
    llm = make_llm(model)
    use_oracle(llm, list(zip(PROMPTS, expected)))
    steps = check_blocks_every_step(llm)
    assert token_ids(generate(llm, PROMPTS, greedy())) == expected
    stats = llm.engine.kv_stats()
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    assert stats["spec_mean_accepted_length"] > 2.0
    for j in range(1, K + 1):
        assert 0.0 < stats[f"spec_acceptance_at_{j}"] < 1.0
    # Accepted drafts make fewer steps than one token a step would.
    assert steps() < NUM_NEW


def test_the_ngram_proposer_keeps_greedy_output_identical(model: TinyModel) -> None:
    prompts = PROMPTS[:3]
    num_new = 40
    llm = make_llm(model)
    check_blocks_every_step(llm)
    assert token_ids(generate(llm, prompts, greedy(num_new))) == [model.greedy(p, num_new) for p in prompts]
    assert llm.engine.kv_stats()["spec_num_draft_tokens"] > 0


def test_chunked_prefill_prefix_cache_and_preemption_with_drafts(model: TinyModel) -> None:
    expected = [model.greedy(p, NUM_NEW) for p in PROMPTS]
    # 26 blocks of 4 tokens cannot hold the four requests at once: some are preempted mid-draft.
    llm = make_llm(model, num_blocks=26, max_num_batched_tokens=12, enable_prefix_caching=True)
    use_oracle(llm, list(zip(PROMPTS, expected)))
    check_blocks_every_step(llm)
    assert token_ids(generate(llm, PROMPTS, greedy())) == expected
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert llm.engine.kv_stats()["spec_num_accepted_tokens"] > 0
    # Again: the prompts now come from the prefix cache, which only ever cached verified tokens.
    assert token_ids(generate(llm, PROMPTS, greedy())) == expected
    assert llm.engine.kv_manager.prefix_hit_tokens > 0


def test_penalties_bias_and_min_tokens_apply_to_every_verified_position(model: TinyModel) -> None:
    params = greedy(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2, logit_bias={17: 2.0})
    plain = token_ids(generate(make_llm(model, None), PROMPTS, params))
    llm = make_llm(model)
    use_oracle(llm, list(zip(PROMPTS, plain)))
    assert token_ids(generate(llm, PROMPTS, params)) == plain
    assert llm.engine.kv_stats()["spec_num_accepted_tokens"] > 0


# ---------------------------------------------------------------- stops, limits, aborts


def test_stop_tokens_max_tokens_and_stop_strings_cut_a_draft_run_where_plain_decoding_stops(
    model: TinyModel,
) -> None:
    prompt = PROMPTS[0]
    reference = model.greedy(prompt, NUM_NEW)
    stop_token = reference[5]
    cases = [
        greedy(6),  # the oracle drafts past max_tokens
        SamplingParams(temperature=0.0, max_tokens=NUM_NEW, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.0, max_tokens=NUM_NEW, stop=[word(reference[7])], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=NUM_NEW, min_tokens=9, stop_token_ids=[stop_token]),
    ]
    plain = make_llm(model, None)
    llm = make_llm(model)
    use_oracle(llm, [(prompt, reference)])
    for params in cases:
        want = generate(plain, [prompt], params)[0].outputs[0]
        got = generate(llm, [prompt], params)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids,
            want.text,
            want.finish_reason,
            want.stop_reason,
        )
    assert llm.engine.kv_stats()["spec_num_accepted_tokens"] > 0


def test_an_abort_while_a_drafted_step_runs_frees_everything(model: TinyModel) -> None:
    expected = [model.greedy(p, NUM_NEW) for p in PROMPTS[:2]]
    llm = make_llm(model)
    use_oracle(llm, list(zip(PROMPTS[:2], expected)))
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(
            EngineCoreRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=greedy())
        )
    execute = engine.executor.execute
    aborted = []

    def abort_mid_draft(plan):  # type: ignore[no-untyped-def]
        result = execute(plan)
        if not aborted and any(entry.draft_token_ids and entry.request_id == "0" for entry in plan.scheduled):
            aborted.append(engine.abort_requests(["0"]))
        return result

    engine.executor.execute = abort_mid_draft  # type: ignore[method-assign]
    tokens: dict[str, list[int]] = {"0": [], "1": []}
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            tokens[output.request_id].extend(output.new_token_ids)
        engine.kv_manager.check_integrity()
    assert aborted == [["0"]]
    assert tokens["1"] == expected[1]
    assert engine.kv_manager.all_free_or_cached()


# ---------------------------------------------------------------- logprobs and sampling


def test_logprobs_are_the_targets_at_every_verified_position(model: TinyModel) -> None:
    params = greedy(logprobs=3)
    plain = generate(make_llm(model, None), PROMPTS, params)
    llm = make_llm(model)
    use_oracle(llm, [(p, o.outputs[0].token_ids) for p, o in zip(PROMPTS, plain)])
    got = generate(llm, PROMPTS, params)
    for want, have in zip(plain, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        assert len(have.outputs[0].logprobs) == NUM_NEW
        for a, b in zip(want.outputs[0].logprobs, have.outputs[0].logprobs):
            assert a.keys() == b.keys()
            for token in a:
                assert b[token].logprob == pytest.approx(a[token].logprob, abs=1e-4)
                assert b[token].rank == a[token].rank
    assert llm.engine.kv_stats()["spec_num_accepted_tokens"] > 0


def test_seeded_sampling_with_drafts_is_what_it_is_without_them(model: TinyModel) -> None:
    """n-gram drafts are verified by drawing each token as plain sampling does, so a seeded request's
    output does not depend on how many drafts each step verified: it is reproducible run to run
    (adaptive drafting follows measured step times) and equal to its output without speculation."""
    params = SamplingParams(temperature=0.9, top_k=40, seed=11, n=3, max_tokens=30, ignore_eos=True)
    prompts = PROMPTS[:3]
    plain = [[c.token_ids for c in o.outputs] for o in generate(make_llm(model, None), prompts, params)]
    for _ in range(2):
        llm = make_llm(model, enable_prefix_caching=True)
        use_oracle(llm, [(p, c) for p, samples in zip(prompts, plain) for c in samples])
        assert [[c.token_ids for c in o.outputs] for o in generate(llm, prompts, params)] == plain
        assert llm.engine.kv_stats()["spec_num_accepted_tokens"] > 0


# ---------------------------------------------------------------- configuration and errors


def test_bad_configs_are_clear_errors() -> None:
    with pytest.raises(ValueError, match='"eagle" needs "model"'):
        build_engine_config("m", speculative_config={"method": "eagle"}).validate()
    with pytest.raises(ValueError, match='"draft_model" needs "model"'):
        build_engine_config("m", speculative_config={"method": "draft_model"}).validate()
    with pytest.raises(ValueError, match="method must be one of"):
        build_engine_config("m", speculative_config={"method": "magic"}).validate()
    with pytest.raises(ValueError, match="unknown key 'k'"):
        build_engine_config("m", speculative_config={"k": 3})
    with pytest.raises(ValueError, match="prompt_lookup_min and prompt_lookup_max"):
        build_engine_config(
            "m", speculative_config={"prompt_lookup_min": 4, "prompt_lookup_max": 2}
        ).validate()


def test_structured_outputs_verify_drafts_against_the_grammar(structured_model_dir: str) -> None:
    """Drafts the grammar rejects are not verified, every verified position is masked, the matcher
    follows only the emitted tokens, and jump-forward goes on after a verification: seeded and greedy
    outputs equal those without speculation, and every one validates."""
    import json

    import jsonschema
    from test_structured_outputs import PROMPTS as TEXTS
    from test_structured_outputs import SCHEMAS, json_params

    params = [json_params(SCHEMAS[i % len(SCHEMAS)], seed=40 + i, n=2, max_tokens=120) for i in range(4)]
    params[3] = json_params(SCHEMAS[3], temperature=0.0, max_tokens=120)
    options: dict[str, object] = {"dtype": "float32", "max_model_len": 512, "num_blocks": 256}
    plain = LLM(structured_model_dir, **options).generate(TEXTS, params, use_tqdm=False)
    llm = LLM(structured_model_dir, speculative_config=SPEC, **options)
    tokenizer = llm.get_tokenizer()
    oracle = use_oracle(
        llm, [(tokenizer.encode(t), c.token_ids) for t, o in zip(TEXTS, plain) for c in o.outputs]
    )
    oracle.vocab = len(tokenizer)
    got = llm.generate(TEXTS, params, use_tqdm=False)
    for i, (want, have) in enumerate(zip(plain, got)):
        assert [c.token_ids for c in have.outputs] == [c.token_ids for c in want.outputs]
        for completion in have.outputs:
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), SCHEMAS[i % len(SCHEMAS)])
    stats = llm.engine.kv_stats()
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]


def test_adaptive_drafting_stops_on_a_compute_bound_step() -> None:
    """With every second of a step going to its tokens (a compute-bound batch), no draft pays; with
    a large fixed cost (an idle CPU streaming weights), every draft the request's rate supports does."""
    from tokenmill.core.request import Request

    def state_after(fixed: float, per_token: float) -> SpecDecodeState:
        step_time = StepTimeModel()
        for tokens, seqs in [(8, 8), (16, 8), (24, 8), (40, 16), (20, 16), (64, 32), (40, 32)]:
            step_time.observe(tokens, seqs, fixed + per_token * tokens)
        state = SpecDecodeState(SpeculativeConfig(num_speculative_tokens=K), step_time)
        state.num_drafted_steps = EXPLORE_STEPS  # past the exploring steps
        state.begin_step(num_running=32)
        return state

    core_request = EngineCoreRequest(request_id="r", prompt_token_ids=[1, 2, 3], sampling_params=greedy())
    request = Request(core_request, max_model_len=64)
    request.num_computed_tokens = 2
    request.draft_token_ids = [4, 5, 6, 7]
    request.draft_acceptance = 0.8
    assert state_after(fixed=0.0, per_token=0.01).num_drafts_to_plan(request) == 0
    request.draft_acceptance = 0.8
    assert state_after(fixed=0.5, per_token=0.0001).num_drafts_to_plan(request) == K


def test_the_cli_flag_and_the_config_crossing_processes() -> None:
    import argparse

    import msgspec

    from tokenmill.config import EngineConfig
    from tokenmill.engine_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    config = build_engine_config("m", **engine_kwargs(args))
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    assert msgspec.json.decode(msgspec.json.encode(config), type=EngineConfig) == config
    assert build_engine_config("m", **engine_kwargs(parser.parse_args([]))).speculative_config is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", '{"method": "eagle"}'])


@pytest.mark.parametrize(
    "setting", [{"executor_backend": "mp", "num_threads": 1}, {"model_impl": "transformers"}]
)
def test_the_worker_process_and_the_transformers_fallback_verify_drafts(
    model: TinyModel, setting: dict[str, object]
) -> None:
    prompts = PROMPTS[:3]
    num_new = 40
    llm = make_llm(model, **setting)
    try:
        got = token_ids(generate(llm, prompts, greedy(num_new)))
        assert got == [model.greedy(p, num_new) for p in prompts]
        assert llm.engine.kv_stats()["spec_num_draft_tokens"] > 0
    finally:
        llm.engine.shutdown()


def test_plans_with_drafts_round_trip_as_deltas(model: TinyModel) -> None:
    import msgspec

    from tokenmill.executor.plan_delta import PlanDecoder, PlanEncoder, output_from_wire, output_to_wire
    from tokenmill.protocol import StepDone, StepPlanData

    expected = [model.greedy(p, NUM_NEW) for p in PROMPTS]
    llm = make_llm(model, max_num_batched_tokens=12)
    use_oracle(llm, list(zip(PROMPTS, expected)))
    encoder, decoder = PlanEncoder(), PlanDecoder()
    execute = llm.engine.executor.execute
    num_drafted = [0]

    def round_trip(plan):  # type: ignore[no-untyped-def]
        data = msgspec.msgpack.decode(msgspec.msgpack.encode(encoder.encode(plan)), type=StepPlanData)
        assert decoder.decode(data).scheduled == plan.scheduled
        num_drafted[0] += sum(bool(entry.draft_token_ids) for entry in plan.scheduled)
        result = execute(plan)
        wire = msgspec.msgpack.decode(msgspec.msgpack.encode(output_to_wire(result)), type=StepDone)
        assert output_from_wire(wire) == result
        return result

    llm.engine.executor.execute = round_trip  # type: ignore[method-assign]
    assert token_ids(generate(llm, PROMPTS, greedy(logprobs=1))) == expected
    assert num_drafted[0] > 0


def test_a_draft_model_keeps_greedy_and_seeded_outputs_and_frees_its_blocks(
    model: TinyModel, tiny_model: Callable[[str], TinyModel]
) -> None:
    """The target itself as drafter accepts most drafts (every greedy one); another model of the same
    vocabulary gets drafts rejected. Either way outputs are those without speculation, and the
    drafter's cache blocks all come back when the requests end."""
    from tokenmill.worker.draft_model import DraftModelProposer

    greedy_params = greedy()
    seeded = SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=NUM_NEW, ignore_eos=True)
    plain = make_llm(model, None)
    want_greedy = token_ids(generate(plain, PROMPTS, greedy_params))
    want_seeded = [[c.token_ids for c in o.outputs] for o in generate(plain, PROMPTS, seeded)]
    for drafter, min_length in ((model.path, 3.0), (tiny_model("mistral").path, 1.0)):
        spec = {"method": "draft_model", "model": drafter, "num_speculative_tokens": K}
        llm = make_llm(model, spec, num_blocks=64, max_num_batched_tokens=32)
        assert token_ids(generate(llm, PROMPTS, greedy_params)) == want_greedy
        assert [[c.token_ids for c in o.outputs] for o in generate(llm, PROMPTS, seeded)] == want_seeded
        stats = llm.engine.kv_stats()
        assert stats["spec_num_draft_tokens"] > 0
        assert stats["spec_mean_accepted_length"] >= min_length, stats
        proposer = llm.engine.executor.runner.proposer  # type: ignore[attr-defined]
        assert isinstance(proposer, DraftModelProposer)
        llm.engine.executor.execute(llm.engine.scheduler.schedule())  # tells the worker who finished
        assert sorted(proposer.free_blocks) == list(range(proposer.runner.num_blocks))
    with pytest.raises(ValueError, match="must share the target's vocabulary"):
        make_llm(model, {"method": "draft_model", "model": str(tiny_model_dir_of_other_vocab(model))})


def tiny_model_dir_of_other_vocab(model: TinyModel) -> str:
    """A copy of the tiny model's folder whose config says another vocabulary size."""
    import json
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="tiny-other-vocab-")
    shutil.copytree(model.path, folder, dirs_exist_ok=True)
    config_path = f"{folder}/config.json"
    with open(config_path) as f:
        config = json.load(f)
    config["vocab_size"] = 161
    with open(config_path, "w") as f:
        json.dump(config, f)
    return folder


def test_sliding_window_releases_compose_with_drafts(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every layer windowed: blocks behind the window are released while drafts are verified and
    rejected; outputs still match transformers and the pool stays consistent every step."""
    import torch

    from tests.conftest import UNK, TinySpec, save_tiny_model

    folder = str(tmp_path_factory.mktemp("tiny-mistral-window-spec"))
    spec = TinySpec("mistral", "MistralConfig", {"num_key_value_heads": 2, "sliding_window": 6})
    hf = save_tiny_model(spec, seed=11, folder=folder)
    prompts = [[10 + (5 * i + j) % 140 for j in range(length)] for i, length in enumerate((4, 11, 15))]
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=30,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=UNK,
        )
        expected.append(out[0, len(prompt) :].tolist())
    llm = LLM(
        folder,
        dtype="float32",
        num_blocks=64,
        block_size=4,
        max_num_batched_tokens=8,
        speculative_config=SPEC,
    )
    assert llm.engine.kv_manager.sliding_window == 6
    use_oracle(llm, list(zip(prompts, expected)))
    check_blocks_every_step(llm)
    assert token_ids(generate(llm, prompts, greedy(30))) == expected
    assert llm.engine.kv_stats()["spec_num_accepted_tokens"] > 0
