"""The official ``openai`` client, sync and async, against the tiny-model server."""

from __future__ import annotations

import asyncio

import pytest
from server_process import ServerProcess
from tiny_model import words

MODEL = "tiny"
PROMPT = words([5, 6, 7, 8])
# Greedy, never ending early, and never picking <0>/<1> (special tokens: they decode to no text),
# so n tokens are always n words.
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}, "logit_bias": {"0": -100, "1": -100}}


def test_models_lists_the_served_name(tiny_server: ServerProcess) -> None:
    models = tiny_server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert tiny_server.client().models.retrieve(MODEL).id == MODEL


def test_completion_greedy_with_usage(tiny_server: ServerProcess) -> None:
    client = tiny_server.client()
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, **GREEDY)
    second = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, **GREEDY)
    assert first.object == "text_completion"
    assert len(first.choices) == 1
    choice = first.choices[0]
    assert choice.finish_reason == "length"
    assert choice.text == second.choices[0].text  # greedy is deterministic
    assert len(choice.text.split()) == 8
    assert first.usage is not None
    assert (first.usage.prompt_tokens, first.usage.completion_tokens, first.usage.total_tokens) == (4, 8, 12)
    assert first.usage.prompt_tokens_details is not None


def test_prefix_cache_hits_show_in_usage(tiny_server: ServerProcess) -> None:
    client = tiny_server.client()
    prompt = words(list(range(40, 60)))  # 20 tokens: 4 full blocks of 4 can be shared
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_prompt_forms_and_choice_indices(tiny_server: ServerProcess) -> None:
    client = tiny_server.client()
    as_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, **GREEDY)
    as_ids = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=5, **GREEDY)
    assert as_ids.choices[0].text == as_text.choices[0].text
    several = client.completions.create(
        model=MODEL, prompt=[[5, 6, 7, 8], [9, 10]], max_tokens=5, n=2, **GREEDY
    )
    assert sorted(c.index for c in several.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in several.choices}
    assert by_index[0] == by_index[1] == as_text.choices[0].text  # prompt 0 is choices 0..n-1
    assert several.usage is not None and several.usage.prompt_tokens == 6
    assert several.usage.completion_tokens == 20


def test_echo_puts_the_prompt_first(tiny_server: ServerProcess) -> None:
    result = tiny_server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, **GREEDY
    )
    assert result.choices[0].text.startswith(PROMPT)


def test_completion_logprobs(tiny_server: ServerProcess) -> None:
    result = tiny_server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=3, **GREEDY
    )
    logprobs = result.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens is not None and len(logprobs.tokens) == 4
    assert "".join(logprobs.tokens).replace(" ", "") == result.choices[0].text.replace(" ", "")
    assert logprobs.token_logprobs is not None and all(lp <= 0 for lp in logprobs.token_logprobs)
    assert logprobs.top_logprobs is not None
    for token, top in zip(logprobs.tokens, logprobs.top_logprobs):
        assert len(top) == 3
        assert max(top, key=top.__getitem__) == token  # greedy picks the most likely token
    assert logprobs.text_offset is not None
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_echo_with_logprobs_covers_the_prompt(tiny_server: ServerProcess) -> None:
    result = tiny_server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, logprobs=1, echo=True, **GREEDY
    )
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.token_logprobs is not None
    assert logprobs.tokens[:4] == ["<5>", "<6>", "<7>", "<8>"]
    assert logprobs.token_logprobs[0] is None  # the first prompt token has no context
    assert all(lp is not None for lp in logprobs.token_logprobs[1:])
    assert len(logprobs.tokens) == 6


def test_chat_greedy_and_streamed_agree(tiny_server: ServerProcess) -> None:
    client = tiny_server.client()
    messages = [{"role": "system", "content": "<9>"}, {"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, **GREEDY)  # type: ignore[arg-type]
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    text = whole.choices[0].message.content
    assert text and len(text.split()) == 10
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10
    assert whole.usage is not None and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_content_parts(tiny_server: ServerProcess) -> None:
    client = tiny_server.client()
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "<5> <6>"}], max_tokens=4, **GREEDY
    )
    parts = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "<5> <6>"}]}],
        max_tokens=4,
        **GREEDY,
    )
    assert parts.choices[0].message.content == plain.choices[0].message.content


def test_chat_n_samples_stream_with_index(tiny_server: ServerProcess) -> None:
    stream = tiny_server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=12,
        n=3,
        temperature=1.0,
        seed=7,
        stream=True,
    )
    texts = {0: "", 1: "", 2: ""}
    roles = set()
    finished = set()
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.role:
                roles.add(choice.index)
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert roles == finished == {0, 1, 2}
    assert all(texts.values())


def test_chat_logprobs(tiny_server: ServerProcess) -> None:
    result = tiny_server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    choice = result.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert len(content) == 5
    assert "".join(entry.token for entry in content).replace(" ", "") == (
        choice.message.content or ""
    ).replace(" ", "")
    for entry in content:
        assert entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token ranks first
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_stop_string_cuts_the_text(tiny_server: ServerProcess) -> None:
    client = tiny_server.client()
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, **GREEDY).choices[0].text
    stop = full.split()[5]
    expected = full[: full.index(stop)]
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, stop=[stop], **GREEDY)
    assert stopped.choices[0].text == expected
    assert stopped.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, stop=stop, stream=True, **GREEDY
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproducibility(tiny_server: ServerProcess) -> None:
    client = tiny_server.client()

    def sample(seed: int) -> list[str]:
        result = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=16,
            n=3,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return [c.text for c in sorted(result.choices, key=lambda c: c.index)]

    first = sample(1234)
    assert sample(1234) == first
    assert len(set(first)) > 1  # the n samples differ from each other
    assert sample(4321) != first


def test_max_completion_tokens_and_min_tokens(tiny_server: ServerProcess) -> None:
    client = tiny_server.client()
    result = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_completion_tokens=3, temperature=0.0
    )
    assert result.usage is not None and result.usage.completion_tokens <= 3
    eos_first = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0.0,
        logit_bias={"1": 100},
        extra_body={"min_tokens": 4},
    )
    # EOS is by far the likeliest token, yet it cannot end the completion before min_tokens.
    assert eos_first.usage is not None and eos_first.usage.completion_tokens == 5
    assert eos_first.choices[0].finish_reason == "stop"


def test_async_client_concurrent_and_streaming(tiny_server: ServerProcess) -> None:
    async def run() -> None:
        client = tiny_server.async_client()
        prompts = [words([20 + i, 30 + i, 40 + i]) for i in range(6)]
        results = await asyncio.gather(
            *(client.completions.create(model=MODEL, prompt=p, max_tokens=6, **GREEDY) for p in prompts)
        )
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=6, stream=True, **GREEDY
        )
        pieces = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
        whole = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=6, **GREEDY
        )
        await client.close()
        assert all(len(r.choices[0].text.split()) == 6 for r in results)
        assert len({r.choices[0].text for r in results}) > 1
        assert "".join(pieces) == whole.choices[0].message.content

    asyncio.run(run())


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
def test_penalties_and_sampling_knobs_accepted(tiny_server: ServerProcess, penalty: str) -> None:
    result = tiny_server.client().completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=4,
        top_p=0.9,
        user="someone",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
        **{penalty: 0.5},  # type: ignore[arg-type]
    )
    assert result.choices[0].finish_reason in ("stop", "length")
