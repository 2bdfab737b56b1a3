"""``prompt_logprobs_start``: a prompt-logprob request reuses the prefix cache before that position,
and the logprobs it returns from there on are exact."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def model(tiny_model):  # type: ignore[no-untyped-def]
    return tiny_model("llama")


def test_cached_prefix_before_the_start_and_exact_logprobs_after(model) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(model.path, dtype="float32", num_blocks=64, block_size=4, seed=0)
    prefix = [20 + i for i in range(14)]
    llm.generate([{"prompt_token_ids": prefix}], SamplingParams(max_tokens=0), use_tqdm=False)  # prime
    prompt = prefix + [60, 61, 62]
    params = SamplingParams(max_tokens=0, prompt_logprobs=0, prompt_logprobs_start=len(prefix))
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    # Row 13 gives position 14's logprob, so at most 13 tokens (3 whole blocks) come from the cache.
    assert out.num_cached_tokens == 12
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert all(entry is None for entry in out.prompt_logprobs[:13])
    reference = model.log_softmax(prompt)  # [len(prompt), vocab]
    for position in range(13, len(prompt)):
        entry = out.prompt_logprobs[position]
        assert entry is not None
        expected = reference[position - 1, prompt[position]].item()
        assert entry[prompt[position]].logprob == pytest.approx(expected, abs=1e-4)


def test_start_zero_keeps_every_logprob_and_uses_no_cache(model) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(model.path, dtype="float32", num_blocks=64, block_size=4, seed=0)
    prompt = [30 + i for i in range(10)]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=0), use_tqdm=False)
    out = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False
    )[0]
    assert out.num_cached_tokens == 0
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert all(entry is not None for entry in out.prompt_logprobs[1:])


def test_a_negative_start_is_refused() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs_start must be an integer >= 0"):
        SamplingParams(prompt_logprobs=0, prompt_logprobs_start=-1)
