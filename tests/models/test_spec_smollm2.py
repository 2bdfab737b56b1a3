"""Speculative decoding on the real SmolLM2-135M: with n-gram drafts on copy-heavy prompts (a text to
repeat, a list that continues), greedy tokens are identical to transformers' (float32), with many
drafts accepted; the bfloat16 engine gives the same tokens with speculation on and off."""

from __future__ import annotations

import pytest

from tests.models.test_llama_family import hf_greedy, smol_hf, smollm2_gguf
from tokenmill import LLM, SamplingParams

__all__ = ["smol_hf"]  # a fixture, used by name

NUM_NEW = 40
COPY_PROMPTS = [
    "Repeat this code exactly.\n\ndef add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "Repeated:\n\ndef add(a, b):\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
]
SPEC = {"method": "ngram", "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def smol_spec() -> LLM:
    """Float32, every draft found verified: whether the measured gate (core/spec_payoff.py) drafts
    depends on this machine's timings, and this test counts accepted drafts."""
    smollm2_gguf()
    return LLM("smollm2-135m", dtype="float32", num_blocks=64, speculative_config={**SPEC, "adaptive": False})


def test_smollm2_greedy_with_ngram_drafts_matches_transformers(smol_spec: LLM, smol_hf) -> None:  # type: ignore[no-untyped-def]
    tokenizer = smol_spec.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in COPY_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = smol_spec.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(smol_hf, prompt, NUM_NEW), tokenizer.decode(prompt)
    stats = smol_spec.kv_stats()
    assert stats["spec_mean_accepted_length"] > 2.0, stats


CODE = (
    "from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
    '    """ Check if in given list of numbers, are any two numbers closer to each other than\n'
    "    given threshold.\n    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)\n    False\n"
    '    >>> has_close_elements([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3)\n    True\n    """\n'
    "    for idx, elem in enumerate(numbers):\n        for idx2, elem2 in enumerate(numbers):\n"
    "            if idx != idx2:\n                distance = abs(elem - elem2)\n"
    "                if distance < threshold:\n                    return True\n\n    return False\n"
)
COPY_CHAT = [
    {
        "role": "user",
        "content": "Copy this Python function exactly, changing only its name from `has_close_elements` to "
        f"`has_close_elements_v2`. Reply with the code only.\n\n```python\n{CODE}```",
    }
]


def test_smollm2_bfloat16_tokens_are_the_same_with_speculation_on_and_off() -> None:
    """In bfloat16 the verifying step's rows attend as decodes (``rows_as_decodes_preferred``), so they
    round as the decode steps they stand for: this copy request diverged at its 34th token when the
    drafts' rows went through the prefill kernel."""
    smollm2_gguf()
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    results = []
    # Every draft found verified (not adaptive): whether the gate drafts depends on the machine's timings.
    for spec in (None, {**SPEC, "adaptive": False}):
        llm = LLM("smollm2-135m", dtype="bfloat16", num_blocks=64, speculative_config=spec)
        outputs = llm.generate(COPY_PROMPTS, params, use_tqdm=False)
        outputs += llm.chat(COPY_CHAT, params, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outputs])
        if spec is not None:
            assert llm.kv_stats()["spec_mean_accepted_length"] > 2.0
    assert results[0] == results[1]
