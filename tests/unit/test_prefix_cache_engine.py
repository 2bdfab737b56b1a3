"""The radix prefix cache inside the engine: multi-turn reuse, salts, prompt logprobs, n > 1."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def model(tiny_model):  # type: ignore[no-untyped-def]
    return tiny_model("qwen2")


def make_llm(model, prefix: bool = True) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(model.path, dtype="float32", num_blocks=96, block_size=4, enable_prefix_caching=prefix, seed=0)


def greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_multi_turn_reuses_the_previous_turn(model) -> None:  # type: ignore[no-untyped-def]
    """Turn k+1's prompt starts with turn k's prompt and answer: all of it that fills blocks is cached."""
    cached, plain = make_llm(model), make_llm(model, prefix=False)
    conversation = [20 + i for i in range(11)]
    previous_len: int | None = None
    for _turn in range(3):
        hit = cached.generate([{"prompt_token_ids": conversation}], greedy(), use_tqdm=False)[0]
        miss = plain.generate([{"prompt_token_ids": conversation}], greedy(), use_tqdm=False)[0]
        assert hit.outputs[0].token_ids == miss.outputs[0].token_ids
        assert hit.outputs[0].token_ids == model.greedy(conversation, 8)
        assert miss.num_cached_tokens == 0
        if previous_len is not None:
            # Everything computed before (prompt + answer of the last turn) sits in whole blocks.
            assert hit.num_cached_tokens == (previous_len // 4) * 4
        previous_len = len(conversation) + 8 - 1  # the last sampled token was never computed
        conversation = conversation + hit.outputs[0].token_ids + [30, 31, 32]


def test_different_salts_never_share(model) -> None:  # type: ignore[no-untyped-def]
    llm = make_llm(model)
    prompt = [40 + i for i in range(17)]
    params = greedy(4)
    for salt, expected_cached in (("a", 0), ("b", 0), ("a", 16)):
        processor = llm.input_processor
        [core_request] = processor.make_requests(
            f"salted-{salt}-{expected_cached}", prompt, params, cache_salt=salt
        )
        state = llm.output_processor.add_request(core_request.request_id, None, prompt, params)
        llm.engine.add_request(core_request)
        while not state.finished:
            llm.output_processor.process(llm.engine.step().outputs)
        assert state.num_cached_tokens == expected_cached


def test_prompt_logprobs_stay_exact_with_a_warm_cache(model) -> None:  # type: ignore[no-untyped-def]
    llm = make_llm(model)
    prompt = [50 + i for i in range(21)]
    llm.generate([{"prompt_token_ids": prompt}], greedy(2), use_tqdm=False)  # warm the cache
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert output.num_cached_tokens == 0  # prompt logprobs need every position's logits
    reference = model.log_softmax(prompt)
    assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        entry = output.prompt_logprobs[position]
        assert entry is not None
        expected = reference[position - 1, prompt[position]].item()
        assert abs(entry[prompt[position]].logprob - expected) < 1e-4


def test_n_samples_with_the_cache_on_match_the_cache_off(model) -> None:  # type: ignore[no-untyped-def]
    prompt = [60 + i for i in range(19)]
    params = SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=6, ignore_eos=True)
    on = make_llm(model).generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    off = make_llm(model, prefix=False).generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert [c.token_ids for c in on.outputs] == [c.token_ids for c in off.outputs]


def test_eviction_under_pressure_keeps_outputs_exact(model) -> None:  # type: ignore[no-untyped-def]
    """A pool too small to keep every prefix: old cached blocks are evicted, never a wrong answer."""
    llm = LLM(model.path, dtype="float32", num_blocks=20, block_size=4, max_num_seqs=2)
    prompts = [[70 + (i * 13 + j) % 80 for j in range(15)] for i in range(6)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(6), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == model.greedy(prompt, 6)
    radix = llm.engine.kv_manager.radix
    # Caching every request's five blocks would take 30 blocks: the oldest prefix must have gone.
    # (The namespace is the cache salt, the weights' generation and the LoRA load: KVCacheManager.namespace.)
    assert radix.peek_prefix_blocks((None, 0, None), prompts[0][:12]) < 3
    assert radix.peek_prefix_blocks((None, 0, None), prompts[-1][:12]) == 3


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_requests_arriving_together_share_a_new_prefix_in_its_first_step(tiny_model, model_type) -> None:  # type: ignore[no-untyped-def]
    """Four requests with a common, uncached prefix arrive together: the first computes the prefix
    and the others attend to its blocks in the same step (each layer writes the step's KV before
    anyone attends), so all four sample their first token in one step, each with the exact output
    it has with the cache off. In bfloat16 on Llama the others' short chunks go through the fused
    decode stack's kernel, which also reads the blocks written in the same layer."""
    model = tiny_model(model_type)
    shared = [30 + (7 * i) % 50 for i in range(22)]  # 5 whole blocks of 4 and 2 tokens
    prompts = [shared + [90 + k, 91 + k, 92 + k] for k in range(4)]
    for dtype in ("float32", "bfloat16"):
        llm = LLM(model.path, dtype=dtype, num_blocks=96, block_size=4, enable_prefix_caching=True, seed=0)
        states = []
        for k, prompt in enumerate(prompts):
            [core_request] = llm.input_processor.make_requests(f"together-{k}", prompt, greedy(5))
            states.append(llm.output_processor.add_request(core_request.request_id, None, prompt, greedy(5)))
            llm.engine.add_request(core_request)
        llm.output_processor.process(llm.engine.step().outputs)
        assert [len(s.samples[0].token_ids) for s in states] == [1, 1, 1, 1]
        while not all(s.finished for s in states):
            llm.output_processor.process(llm.engine.step().outputs)
        assert [s.num_cached_tokens for s in states] == [0, 20, 20, 20]
        off = LLM(model.path, dtype=dtype, num_blocks=96, block_size=4, enable_prefix_caching=False, seed=0)
        expected = [
            o.outputs[0].token_ids
            for o in off.generate([{"prompt_token_ids": p} for p in prompts], greedy(5), use_tqdm=False)
        ]
        assert [s.samples[0].token_ids for s in states] == expected
        if dtype == "float32":
            assert expected == [model.greedy(p, 5) for p in prompts]
