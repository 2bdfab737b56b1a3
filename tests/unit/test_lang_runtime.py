"""tokenmill.lang on the in-process Runtime, checked against transformers on a tiny random model.

The tiny tokenizer is word-level (``w5 w6 ...``) with a chat template ``<|role|> content ``, so
every text below is made of its words.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tokenmill.lang import ProgramError, Runtime, assistant, function, gen, select, system, user
from tokenmill.lang.backend import choice_span
from tokenmill.lang.prefix_groups import plan_batch


@pytest.fixture(scope="module")
def model(tiny_model):  # type: ignore[no-untyped-def]
    return tiny_model("llama")


@pytest.fixture(scope="module")
def runtime(model) -> Iterator[Runtime]:  # type: ignore[no-untyped-def]
    backend = Runtime(model.path, dtype="float32", num_blocks=256, block_size=4, seed=0)
    yield backend
    backend.shutdown()


def words(*ids: int) -> str:
    return " ".join(f"w{i}" for i in ids)


def greedy_ids(runtime: Runtime, prompt: str, text: str) -> list[int]:
    """The token ids a completion ``text`` of ``prompt`` stands for (word-level: re-tokenizing is exact)."""
    prompt_ids = runtime.encode(prompt)
    return runtime.encode(prompt + text)[len(prompt_ids) :]


def test_gen_at_temperature_zero_is_transformers_greedy(runtime: Runtime, model) -> None:  # type: ignore[no-untyped-def]
    @function
    def program(s, start):  # type: ignore[no-untyped-def]
        s += start
        s += gen("x", max_tokens=6, temperature=0, ignore_eos=True)

    prompt = words(10, 11, 12, 13) + " "  # word-level text: the generated words need a separator
    state = program.run(start=prompt, backend=runtime)
    assert greedy_ids(runtime, prompt, state["x"]) == model.greedy(runtime.encode(prompt), 6)
    assert state.text() == prompt + state["x"]
    meta = state.get_meta_info("x")
    assert meta["completion_tokens"] == 6 and meta["prompt_tokens"] == 4 and meta["finish_reason"] == "length"
    again = program.run(start=prompt, backend=runtime)
    assert again["x"] == state["x"]  # deterministic at temperature 0


def test_role_blocks_render_the_chat_template_and_messages(runtime: Runtime) -> None:
    @function
    def chat(s):  # type: ignore[no-untyped-def]
        s += system(words(20))
        s += user(words(21, 22))
        s += assistant(gen("reply", max_tokens=3, temperature=0, ignore_eos=True))
        with s.user():
            s += words(23)

    state = chat.run(backend=runtime)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[2]["content"] == state["reply"]
    rendered = runtime.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert state.text() == rendered


def _reference_scores(model, runtime: Runtime, prompt: str, choices: list[str]) -> list[float]:  # type: ignore[no-untyped-def]
    prompt_ids = runtime.encode(prompt)
    scores = []
    for choice in choices:
        full = runtime.encode(prompt + choice)
        logprobs = model.log_softmax(full)  # [len(full), vocab]
        start = choice_span(prompt_ids, full)
        values = [logprobs[p - 1, full[p]].item() for p in range(start, len(full))]
        scores.append(sum(values) / len(values))
    return scores


def test_select_is_the_argmax_of_normalised_transformers_logprobs(runtime: Runtime, model) -> None:  # type: ignore[no-untyped-def]
    prompt = words(30, 31, 32) + " "
    choices = [words(40, 41), words(50), words(60, 61, 62), words(70)]

    @function
    def pick(s):  # type: ignore[no-untyped-def]
        s += prompt
        s += select("choice", choices=choices)

    state = pick.run(backend=runtime)
    expected = _reference_scores(model, runtime, prompt, choices)
    got = state.get_meta_info("choice")["normalized_logprobs"]
    assert got == pytest.approx(expected, abs=1e-4)
    assert state["choice"] == choices[max(range(len(choices)), key=lambda i: expected[i])]
    assert state.text() == prompt + state["choice"]

    # gen(choices=...) is the same select
    @function
    def pick_by_gen(s):  # type: ignore[no-untyped-def]
        s += prompt
        s += gen("choice", choices=choices)

    assert pick_by_gen.run(backend=runtime)["choice"] == state["choice"]


def test_select_never_generates_and_takes_the_prompt_from_the_cache(runtime: Runtime) -> None:
    """The prompt is primed once, then one prompt-only request per choice, admitted together, whose
    logprobs start at the choice: the prompt's whole blocks come from the cache, nothing is generated."""

    @function
    def pick(s):  # type: ignore[no-untyped-def]
        s += words(*range(133, 146)) + " "  # 13 tokens: three whole blocks of 4
        s += select("c", choices=[words(35), words(36)])

    state = pick.run(backend=runtime)
    [record] = state.trace.records
    assert record.kind == "select" and record.completion_tokens == 0
    assert record.prompt_tokens == 13 + 14 + 14
    assert record.cached_tokens == 12 + 12  # the two choices; the priming computed the prompt
    assert runtime.llm.kv_stats()["num_running"] == 0


def test_fork_primes_the_prefix_once_and_joins_in_order(runtime: Runtime) -> None:
    prefix = words(*range(80, 101))

    @function
    def branches(s):  # type: ignore[no-untyped-def]
        s += prefix
        forks = s.fork(3)
        for i, branch in enumerate(forks):
            branch += " " + words(110 + i) + " "
            branch += gen("tail", max_tokens=4, temperature=0, ignore_eos=True)
        forks.join()
        return [branch["tail"] for branch in forks], [branch.text() for branch in forks]

    state = branches.run(backend=runtime)
    tails, texts = state.ret_value
    for i, (tail, text) in enumerate(zip(tails, texts)):
        assert text == prefix + " " + words(110 + i) + " " + tail
        alone = runtime.llm.generate(
            [prefix + " " + words(110 + i) + " "],
            __import__("tokenmill").SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
            use_tqdm=False,
        )[0]
        assert tail == alone.outputs[0].text
    records = state.trace.records
    assert records[0].kind == "prime" and records[0].lane == "0"
    gens = [r for r in records if r.kind == "gen"]
    assert sorted(r.lane for r in gens) == ["0.1", "0.2", "0.3"]
    assert all(r.start >= records[0].end for r in gens)
    assert all(r.cached_tokens >= 20 for r in gens)  # the primed prefix's five full blocks
    assert '<div class="bar"' in state.trace.to_html()


def test_text_iter_streams_the_generation(runtime: Runtime) -> None:
    @function
    def program(s):  # type: ignore[no-untyped-def]
        s += words(120, 121) + " "
        s += gen("x", max_tokens=8, temperature=0, ignore_eos=True)

    state = program.run(backend=runtime, stream=True)
    pieces = list(state.text_iter("x"))
    assert len(pieces) >= 2 and "".join(pieces) == state["x"]


def test_a_failing_call_raises_program_error_and_the_runtime_keeps_serving(runtime: Runtime) -> None:
    @function
    def too_long(s):  # type: ignore[no-untyped-def]
        s += words(*([50] * 300))
        s += gen("x", max_tokens=4)

    with pytest.raises(ProgramError, match="maximum context length"):
        too_long.run(backend=runtime)

    @function
    def fine(s):  # type: ignore[no-untyped-def]
        s += words(51, 52)
        s += gen("x", max_tokens=2, temperature=0, ignore_eos=True)

    assert fine.run(backend=runtime)["x"]


def test_run_batch_keeps_input_order_groups_prefixes_and_shows_progress(runtime: Runtime, capsys) -> None:  # type: ignore[no-untyped-def]
    shared_a = words(*range(5, 40))
    shared_b = words(*range(40, 75))

    @function
    def program(s, prefix, tail):  # type: ignore[no-untyped-def]
        s += prefix + " " + tail + " "
        s += gen("x", max_tokens=3, temperature=0, ignore_eos=True)

    batch = [
        {"prefix": shared_a, "tail": words(130)},
        {"prefix": shared_b, "tail": words(131)},
        {"prefix": shared_a, "tail": words(132)},
        {"prefix": shared_b, "tail": words(133)},
    ]
    plan = plan_batch(program.body, runtime, batch)
    assert plan.order == [1, 3, 0, 2]  # sorted by prefix text: "w40 ..." before "w5 ..."
    assert plan.shared_prefixes == [shared_b + " w13", shared_a + " w13"]
    states = program.run_batch(batch, backend=runtime, num_threads=2, progress_bar=True)
    for kwargs, state in zip(batch, states):
        assert state.text().startswith(kwargs["prefix"] + " " + kwargs["tail"])
        assert state["x"] == program.run(backend=runtime, **kwargs)["x"]
    assert "4/4" in capsys.readouterr().err
    primes = [r for r in states[0].trace.records if r.kind == "prime"]
    assert len(primes) == 2


def test_gen_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at most one of regex and json_schema"):
        gen("x", regex="a", json_schema={"type": "string"})
    with pytest.raises(ValueError, match="non-empty list"):
        select("x", choices=[])
    with pytest.raises(ValueError, match="tool_choice"):
        gen("x", tools=[len], tool_choice="sometimes")
