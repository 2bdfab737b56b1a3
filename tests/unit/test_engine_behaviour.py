"""The whole engine on a tiny random Llama: batching, chunking, preemption, prefix cache, sampling
options, stop conditions and errors, each checked against transformers' greedy output."""

from __future__ import annotations

import random

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.core.step_io import SchedulerOutput

NUM_NEW = 12


def make_prompts() -> list[list[int]]:
    rng = random.Random(99)
    return [[rng.randrange(5, 160) for _ in range(n)] for n in (3, 9, 14, 22, 30)]


PROMPTS = make_prompts()


def inputs(prompts: list[list[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": p} for p in prompts]


def greedy(max_tokens: int = NUM_NEW, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def token_ids(outputs) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def model(tiny_model):  # type: ignore[no-untyped-def]
    return tiny_model("llama")


@pytest.fixture(scope="module")
def expected(model) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """transformers' greedy continuations of PROMPTS."""
    return [model.greedy(p, NUM_NEW) for p in PROMPTS]


def make_llm(model, **kwargs: object) -> LLM:  # type: ignore[no-untyped-def]
    options: dict[str, object] = {"dtype": "float32", "block_size": 4, "num_blocks": 128}
    options.update(kwargs)
    return LLM(model.path, **options)


@pytest.fixture(scope="module")
def llm(model) -> LLM:  # type: ignore[no-untyped-def]
    return make_llm(model)


def record_plans(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[SchedulerOutput]:
    """Keep every plan the engine's scheduler makes from now on."""
    plans: list[SchedulerOutput] = []
    schedule = llm.engine.scheduler.schedule

    def recording() -> SchedulerOutput:
        plan = schedule()
        plans.append(plan)
        return plan

    monkeypatch.setattr(llm.engine.scheduler, "schedule", recording)
    return plans


# ---------------------------------------------------------------- batching never changes the result


def test_alone_and_batched_give_the_same_tokens(llm: LLM, expected) -> None:  # type: ignore[no-untyped-def]
    batched = llm.generate(inputs(PROMPTS), greedy(), use_tqdm=False)
    assert token_ids(batched) == expected
    reversed_batch = llm.generate(inputs(PROMPTS[::-1]), greedy(), use_tqdm=False)
    assert token_ids(reversed_batch) == expected[::-1]
    for prompt, tokens in zip(PROMPTS, expected):
        assert token_ids(llm.generate(inputs([prompt]), greedy(), use_tqdm=False)) == [tokens]


def test_chunked_prefill_under_a_small_budget(model, expected, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    llm = make_llm(model, max_num_batched_tokens=8)
    plans = record_plans(llm, monkeypatch)
    assert token_ids(llm.generate(inputs(PROMPTS), greedy(), use_tqdm=False)) == expected
    assert max(plan.num_tokens for plan in plans) <= 8
    entries = [e for plan in plans for e in plan.scheduled]
    assert any(len(e.token_ids) > 1 and not e.sample for e in entries), "no prompt was split"
    mixed = [
        plan
        for plan in plans
        if any(e.start_position >= len(e.prompt_token_ids) for e in plan.scheduled)  # a decode
        and any(e.start_position < len(e.prompt_token_ids) for e in plan.scheduled)  # a prompt chunk
    ]
    assert mixed, "no step mixed a decode with a prefill chunk"


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_under_a_tiny_pool_keeps_outputs_exact(model, expected, prefix_caching: bool) -> None:  # type: ignore[no-untyped-def]
    # 12 blocks of 4 tokens: the longest request (30 + 12 tokens) fits alone, the batch does not.
    llm = make_llm(model, num_blocks=12, enable_prefix_caching=prefix_caching)
    outputs = llm.generate(inputs(PROMPTS), greedy(), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert token_ids(outputs) == expected


def test_prefix_caching_on_and_off_agree(model) -> None:  # type: ignore[no-untyped-def]
    shared = PROMPTS[-1][:17]  # four full blocks and one more token
    prompts = [shared + [5 + k] * k for k in range(1, 5)] + [shared]
    reference = [model.greedy(p, NUM_NEW) for p in prompts]
    for caching in (False, True):
        llm = make_llm(model, enable_prefix_caching=caching)
        first = llm.generate(inputs(prompts[:1]), greedy(), use_tqdm=False)
        rest = llm.generate(inputs(prompts[1:]), greedy(), use_tqdm=False)
        assert token_ids(first + rest) == reference, f"prefix caching {caching}"
        assert first[0].num_cached_tokens == 0
        # With the cache, the later prompts reuse the four full blocks of the shared prefix.
        assert [o.num_cached_tokens for o in rest] == [16 if caching else 0] * len(rest)


def test_chat_renders_the_template_and_generates(llm: LLM, model) -> None:  # type: ignore[no-untyped-def]
    messages = [
        {"role": "system", "content": "w20 w21"},
        {"role": "user", "content": "w30 w31 w32"},
    ]
    output = llm.chat(messages, greedy(), use_tqdm=False)[0]
    tokenizer = llm.get_tokenizer()
    expected_prompt = tokenizer.convert_tokens_to_ids(
        ["<|system|>", "w20", "w21", "<|user|>", "w30", "w31", "w32", "<|assistant|>"]
    )
    assert output.prompt_token_ids == expected_prompt
    assert output.outputs[0].token_ids == model.greedy(expected_prompt, NUM_NEW)


# ---------------------------------------------------------------- sampling


def test_seeded_sampling_is_reproducible_in_any_batch(model) -> None:  # type: ignore[no-untyped-def]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=NUM_NEW, ignore_eos=True)
    others = [
        SamplingParams(temperature=1.0, seed=7, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=NUM_NEW, ignore_eos=True),
        greedy(),
    ]
    target = PROMPTS[2]
    alone = make_llm(model).generate(inputs([target]), seeded, use_tqdm=False)[0].outputs[0].token_ids

    in_batch = make_llm(model).generate(
        inputs([PROMPTS[0], target, PROMPTS[4], PROMPTS[1]]),
        [others[0], seeded, others[1], others[2]],
        use_tqdm=False,
    )
    chunked = make_llm(model, max_num_batched_tokens=8).generate(
        inputs([PROMPTS[3], PROMPTS[1], target]), [others[2], others[1], seeded], use_tqdm=False
    )
    assert in_batch[1].outputs[0].token_ids == alone
    assert chunked[2].outputs[0].token_ids == alone

    other_seed = make_llm(model).generate(inputs([target]), seeded.clone(seed=4321), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_greedy_samples_all_follow_the_reference(llm: LLM, expected) -> None:  # type: ignore[no-untyped-def]
    outputs = llm.generate(inputs(PROMPTS[3:]), greedy(n=3), use_tqdm=False)
    for output, tokens in zip(outputs, expected[3:]):
        assert [c.index for c in output.outputs] == [0, 1, 2]
        assert [c.token_ids for c in output.outputs] == [tokens] * 3


def test_n_random_samples_differ_and_are_reproducible(llm: LLM) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    first = llm.generate(inputs(PROMPTS[1:2]), params, use_tqdm=False)[0]
    samples = [tuple(c.token_ids) for c in first.outputs]
    assert len(samples) == 4 and all(len(s) == 8 for s in samples)
    assert len(set(samples)) > 1
    again = llm.generate(inputs(PROMPTS[1:2]), params, use_tqdm=False)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == samples


def test_n_siblings_share_the_prompt_blocks(model) -> None:  # type: ignore[no-untyped-def]
    llm = make_llm(model, enable_prefix_caching=False)  # any sharing comes from the siblings
    prompt = PROMPTS[4]  # 30 tokens: 7 full blocks before the last prompt token
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True)
    core_requests = llm.input_processor.make_requests("group", prompt, params)
    for core_request in core_requests:
        llm.engine.add_request(core_request)
    kv = llm.engine.kv_manager
    child_ids = [r.request_id for r in core_requests]
    while not all(kv.has_allocation(i) for i in child_ids):
        llm.engine.step()
    tables = [kv.block_table(i) for i in child_ids]
    assert tables[0][:7] == tables[1][:7] == tables[2][:7]
    assert kv.pool.num_used == len(set().union(*tables)) < sum(len(t) for t in tables)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


# ---------------------------------------------------------------- stop conditions


def test_stop_string_across_token_boundaries(llm: LLM, expected) -> None:  # type: ignore[no-untyped-def]
    full = llm.generate(inputs(PROMPTS[:2]), greedy(), use_tqdm=False)
    text = full[0].outputs[0].text
    assert text.split() == llm.get_tokenizer().convert_ids_to_tokens(expected[0])
    # The tail of the 4th token's text, the space and the head of the 5th token's text.
    boundary = len(" ".join(text.split()[:4]))
    stop = text[boundary - 2 : boundary + 3]
    cut = text.find(stop)
    assert cut >= 0

    params = [greedy(stop=[stop, "never-produced"]), greedy()]
    stopped, untouched = llm.generate(inputs(PROMPTS[:2]), params, use_tqdm=False)
    completion = stopped.outputs[0]
    assert completion.text == text[:cut]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    # Generation ran exactly until the token that completed the stop string.
    completing_token = len(text[: cut + len(stop)].split()) - 1
    assert completion.token_ids == expected[0][: completing_token + 1]
    assert untouched.outputs[0].token_ids == expected[1] and untouched.outputs[0].finish_reason == "length"

    kept = llm.generate(
        inputs(PROMPTS[:1]), greedy(stop=stop, include_stop_str_in_output=True), use_tqdm=False
    )
    assert kept[0].outputs[0].text == text[: cut + len(stop)]


def test_stop_token_ids(llm: LLM, expected) -> None:  # type: ignore[no-untyped-def]
    tokens = expected[3]
    stop_token = tokens[6]
    first = tokens.index(stop_token)
    output = llm.generate(inputs(PROMPTS[3:4]), greedy(stop_token_ids=[stop_token]), use_tqdm=False)[0]
    completion = output.outputs[0]
    assert completion.token_ids == tokens[: first + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_token


def test_eos_stops_unless_ignored_and_min_tokens_holds_it_back(llm: LLM) -> None:
    eos = llm.get_tokenizer().eos_token_id
    eos_first = {eos: 100.0}  # make eos the model's first choice at every step
    prompt = inputs(PROMPTS[:1])
    output = llm.generate(prompt, SamplingParams(temperature=0.0, logit_bias=eos_first), use_tqdm=False)[0]
    assert output.outputs[0].token_ids == [eos] and output.outputs[0].finish_reason == "stop"
    assert output.outputs[0].text == ""

    params = SamplingParams(temperature=0.0, logit_bias=eos_first, min_tokens=4)
    tokens = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert len(tokens.token_ids) == 5 and eos not in tokens.token_ids[:4] and tokens.token_ids[4] == eos
    assert tokens.finish_reason == "stop"

    params = SamplingParams(temperature=0.0, logit_bias=eos_first, ignore_eos=True, max_tokens=3)
    ignored = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == [eos] * 3 and ignored.finish_reason == "length"


def test_min_tokens_holds_back_stop_token_ids(llm: LLM) -> None:
    favourite = 42
    params = greedy(logit_bias={favourite: 100.0}, stop_token_ids=[favourite], min_tokens=3)
    completion = llm.generate(inputs(PROMPTS[:1]), params, use_tqdm=False)[0].outputs[0]
    assert len(completion.token_ids) == 4 and favourite not in completion.token_ids[:3]
    assert completion.token_ids[3] == favourite
    assert completion.finish_reason == "stop" and completion.stop_reason == favourite


def test_max_tokens_ends_with_length(llm: LLM, expected) -> None:  # type: ignore[no-untyped-def]
    completion = llm.generate(inputs(PROMPTS[2:3]), greedy(max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert completion.token_ids == expected[2][:5]
    assert completion.finish_reason == "length" and completion.stop_reason is None


# ---------------------------------------------------------------- errors


def test_prompt_longer_than_the_context_window(model, expected) -> None:  # type: ignore[no-untyped-def]
    llm = make_llm(model, max_model_len=32)
    with pytest.raises(ValueError, match=r"context length is 32 tokens.*40 tokens"):
        llm.generate(inputs([list(range(5, 45))]), greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match=r"22 prompt tokens plus max_tokens=12"):
        llm.generate(inputs([PROMPTS[3]]), greedy(), use_tqdm=False)
    assert token_ids(llm.generate(inputs(PROMPTS[:2]), greedy(), use_tqdm=False)) == expected[:2]


def test_request_larger_than_the_kv_pool(model, expected) -> None:  # type: ignore[no-untyped-def]
    llm = make_llm(model, num_blocks=6)  # 24 tokens of KV cache in all
    with pytest.raises(ValueError, match=r"KV cache"):
        llm.generate(inputs([PROMPTS[1]]), greedy(max_tokens=20), use_tqdm=False)
    assert token_ids(llm.generate(inputs([PROMPTS[1]]), greedy(), use_tqdm=False)) == [expected[1]]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("n", 0),
        ("max_tokens", -1),
        ("min_p", 2.0),
        ("logprobs", 100),
    ],
)
def test_invalid_sampling_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict({field: value})


def test_unknown_sampling_field_is_named() -> None:
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams.from_dict({"temprature": 0.5, "max_tokens": 3})
    assert SamplingParams.from_dict({"temperature": 0.5, "max_tokens": 3}).max_tokens == 3


def test_a_bad_prompt_fails_its_call_and_the_engine_keeps_serving(llm: LLM, expected) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(inputs([PROMPTS[0], [5, 10_000]]), greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate(inputs([PROMPTS[0], []]), greedy(), use_tqdm=False)
    # Only the second prompt's parameters are bad; the first must not be left queued either.
    bad_bias = greedy(logit_bias={10_000: 1.0})
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(inputs(PROMPTS[:2]), [greedy(), bad_bias], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert not llm.output_processor.requests
    with pytest.raises(ValueError, match="logit_bias"):
        next(llm.stream({"prompt_token_ids": PROMPTS[0]}, bad_bias))
    assert not llm.output_processor.requests
    assert token_ids(llm.generate(inputs(PROMPTS), greedy(), use_tqdm=False)) == expected


def test_warm_up_teaches_the_step_time_model_and_leaves_no_trace(model, expected) -> None:  # type: ignore[no-untyped-def]
    llm = make_llm(model, admission="ttft", num_blocks=64)  # 256 KV tokens: the warm-up prompts are cut
    core = llm.engine
    assert core.scheduler.step_time.coefficients is None
    core.warm_up()
    # The server's first user steps can already be sized (``core/admission.py``).
    assert core.scheduler.step_time.coefficients is not None
    assert not core.scheduler.has_unfinished() and not core.scheduler.requests
    assert core.kv_manager.pool.num_used == 0 and core.kv_manager.radix.cached_blocks == 0
    assert (core.kv_manager.prefix_queried_tokens, core.kv_manager.prefix_hit_tokens) == (0, 0)
    assert core.scheduler.num_preemptions_total == 0
    outputs = llm.generate(inputs(PROMPTS), greedy())
    assert token_ids(outputs) == expected
    assert [o.num_cached_tokens for o in outputs] == [0] * len(PROMPTS)
