"""``max_tokens=0``: the engine computes the prompt and samples nothing (cache priming, prompt
scoring), on a tiny random Llama checked against transformers."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def model(tiny_model):  # type: ignore[no-untyped-def]
    return tiny_model("llama")


def make_llm(model, **kwargs: object) -> LLM:  # type: ignore[no-untyped-def]
    options: dict[str, object] = {"dtype": "float32", "block_size": 4, "num_blocks": 128}
    options.update(kwargs)
    return LLM(model.path, **options)


def test_zero_max_tokens_computes_the_prompt_and_samples_nothing(model) -> None:  # type: ignore[no-untyped-def]
    llm = make_llm(model)
    prompt = [30 + i for i in range(13)]
    output = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=0), use_tqdm=False)[0]
    assert output.finished
    [completion] = output.outputs
    assert completion.token_ids == [] and completion.text == ""
    assert completion.finish_reason == "length"
    # The prompt's full blocks are now cached: the same prompt matches 12 of its 13 tokens.
    again = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=0), use_tqdm=False)[0]
    assert again.num_cached_tokens == 12
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    primed = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0]
    assert primed.num_cached_tokens == 12
    assert primed.outputs[0].token_ids == model.greedy(prompt, 3)


def test_zero_max_tokens_scores_the_prompt_like_transformers(model) -> None:  # type: ignore[no-untyped-def]
    llm = make_llm(model, max_num_batched_tokens=8)  # chunked: the prompt takes three steps
    prompt = [45 + (i * 7) % 50 for i in range(19)]
    params = SamplingParams(max_tokens=0, prompt_logprobs=2)
    output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert output.outputs[0].token_ids == []
    assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == len(prompt)
    assert output.prompt_logprobs[0] is None
    reference = model.log_softmax(prompt)
    for position in range(1, len(prompt)):
        entry = output.prompt_logprobs[position]
        assert entry is not None
        expected = reference[position - 1, prompt[position]].item()
        assert abs(entry[prompt[position]].logprob - expected) < 1e-4
        top = sorted(entry.values(), key=lambda lp: lp.rank if lp.rank is not None else 99)
        assert top[0].logprob == pytest.approx(reference[position - 1].max().item(), abs=1e-4)


def test_zero_max_tokens_beside_generating_requests_and_with_n(model) -> None:  # type: ignore[no-untyped-def]
    llm = make_llm(model)
    prompts = [[20 + i for i in range(9)], [60 + i for i in range(6)]]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(max_tokens=0, n=2), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)],
        use_tqdm=False,
    )
    assert [c.token_ids for c in outputs[0].outputs] == [[], []]
    assert outputs[1].outputs[0].token_ids == model.greedy(prompts[1], 4)


def test_negative_max_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="max_tokens must be >= 0"):
        SamplingParams(max_tokens=-1)
