"""The deterministic mode on the real SmolLM2-135M in bfloat16 (its own GGUF weights, the kernels and
shapes a user runs): a request's tokens and logprobs are bitwise the same alone, among other
requests, after a prefix-cache hit and under a small chunk size."""

from __future__ import annotations

import random

from tests.models.test_llama_family import smollm2_gguf
from tokenmill import LLM, SamplingParams
from tokenmill.outputs import RequestOutput

PARAMS = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, logprobs=2, ignore_eos=True)


def answer(output: RequestOutput) -> tuple[list[int], list[list[tuple[int, float]]]]:
    completion = output.outputs[0]
    assert completion.logprobs is not None
    return completion.token_ids, [sorted((t, p.logprob) for t, p in lp.items()) for lp in completion.logprobs]


def test_smollm2_bfloat16_deterministic_alone_crowded_cached_and_chunked() -> None:
    smollm2_gguf()
    llm = LLM("smollm2-135m", dtype="bfloat16", deterministic=True, max_model_len=1024)
    tokenizer = llm.get_tokenizer()
    probe = tokenizer.encode("The history of the printing press begins in " * 12)  # ~100 tokens
    rng = random.Random(0)
    others = [[rng.randrange(100, 40000) for _ in range(rng.randrange(5, 120))] for _ in range(20)]

    def run(prompts: list[list[int]], params: SamplingParams, engine: LLM = llm) -> list[RequestOutput]:
        return engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    for params in (PARAMS, SAMPLED):
        llm.reset_prefix_cache()
        alone = answer(run([probe], params)[0])
        crowd = run([*others[:10], probe, *others[10:]], params)
        assert crowd[10].num_cached_tokens > 0  # the probe's prefix came from the cache this time
        assert answer(crowd[10]) == alone
    chunked = LLM(
        "smollm2-135m", dtype="bfloat16", deterministic=True, max_model_len=1024, max_num_batched_tokens=48
    )
    assert answer(run([others[0], probe], PARAMS, chunked)[1]) == answer(run([probe], PARAMS)[0])
