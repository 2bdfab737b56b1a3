"""``max_tokens=0``: a prompt-only request computes (and caches, or scores) its prompt, generates nothing."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def model(tiny_model):  # type: ignore[no-untyped-def]
    return tiny_model("llama")


def test_prompt_only_generates_nothing_and_primes_the_cache(model) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(model.path, dtype="float32", num_blocks=64, block_size=4, seed=0)
    prompt = [20 + i for i in range(13)]
    primed = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=0), use_tqdm=False)[0]
    assert primed.outputs[0].token_ids == [] and primed.outputs[0].text == ""
    assert primed.outputs[0].finish_reason == "length"
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    after = llm.generate([{"prompt_token_ids": prompt + [40, 41]}], params, use_tqdm=False)[0]
    assert after.num_cached_tokens == 12  # the primed prompt's three full blocks
    assert after.outputs[0].token_ids == model.greedy(prompt + [40, 41], 4)


def test_prompt_only_returns_exact_prompt_logprobs(model) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(model.path, dtype="float32", num_blocks=64, block_size=4, seed=0)
    prompt = [30 + i for i in range(9)]
    out = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False
    )[0]
    assert out.outputs[0].token_ids == []
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    reference = model.log_softmax(prompt)  # [len(prompt), vocab]
    for position in range(1, len(prompt)):
        entry = out.prompt_logprobs[position]
        assert entry is not None
        expected = reference[position - 1, prompt[position]].item()
        assert entry[prompt[position]].logprob == pytest.approx(expected, abs=1e-4)


def test_negative_max_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="max_tokens must be >= 0"):
        SamplingParams(max_tokens=-1)
