"""The real SmolLM2-135M through the multi-process executor (``executor/multiproc.py``): greedy tokens
identical to transformers, as in-process (``test_llama_family.py``). A few prompts keep it short."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.models.test_llama_family import SMOL_PLAIN, hf_greedy, smol_hf, smollm2_gguf
from tokenmill import LLM, SamplingParams
from tokenmill.executor.multiproc import MultiProcessExecutor

__all__ = ["smol_hf"]  # a fixture, used by name

NUM_NEW = 16


@pytest.fixture(scope="module")
def smol_mp() -> Iterator[LLM]:
    smollm2_gguf()
    llm = LLM("smollm2-135m", dtype="float32", num_blocks=64, executor_backend="mp", num_threads=1)
    yield llm
    llm.engine.executor.shutdown()


def test_smollm2_greedy_through_the_worker_process_matches_transformers(smol_mp: LLM, smol_hf) -> None:  # type: ignore[no-untyped-def]
    assert isinstance(smol_mp.engine.executor, MultiProcessExecutor)
    tokenizer = smol_mp.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in SMOL_PLAIN[1:3]]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = smol_mp.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(smol_hf, prompt, NUM_NEW), tokenizer.decode(prompt)
