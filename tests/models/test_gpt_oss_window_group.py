"""gpt-oss's sliding layers in a KV group of their own (core/kv/window_group.py, worker/kv_groups.py):
greedy tokens equal to transformers in float32 with the window shorter than the sequences, through
chunked prefill, a prefix-cache hit and preemption forced by the small window pool; the window
group's blocks go back to its pool during a long decode, and every block comes back at the end."""

from __future__ import annotations

import random

import pytest

from tests.conftest import TinyModel, save_tiny_model
from tests.models.test_gpt_oss import GPT_OSS, WINDOW
from tests.models.test_llama_family import as_inputs, greedy
from tokenmill import LLM
from tokenmill.core.kv.manager import cdiv
from tokenmill.core.kv.window_group import WindowGroupKVManager
from tokenmill.protocol import EngineCoreRequest

BLOCK = 4
MAX_HELD = cdiv(WINDOW, BLOCK) + 1


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    folder = str(tmp_path_factory.mktemp("tiny-gpt-oss-window"))
    hf = save_tiny_model(GPT_OSS, seed=11, folder=folder)
    hf.generation_config.eos_token_id = None
    return TinyModel(arch="gpt_oss", path=folder, hf=hf)


def make_llm(model: TinyModel, **options: object) -> LLM:
    settings: dict[str, object] = {
        "dtype": "float32",
        "block_size": BLOCK,
        "num_blocks": 64,
        "max_num_batched_tokens": 16,
        "max_num_seqs": 4,
        "max_model_len": 80,
    }
    settings.update(options)
    return LLM(model.path, **settings)  # type: ignore[arg-type]


def kv_of(llm: LLM) -> WindowGroupKVManager:
    kv = llm.engine.kv_manager
    assert isinstance(kv, WindowGroupKVManager)
    return kv


def prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 160) for _ in range(n)] for n in lengths]


def test_the_window_layers_get_a_smaller_pool_of_their_own(model: TinyModel) -> None:
    llm = make_llm(model)
    runner = llm.engine.executor.runner
    group = runner.window_group
    assert group is not None and group.window == WINDOW and group.window_layers == {0, 2}
    # 4 sequences of cdiv(8, 4) + 1 blocks plus a step's 4, but at least one 80-token context + 1.
    assert group.num_window_blocks == 21 and group.num_full_blocks == 64
    assert [c.shape[1] for c in runner.kv_caches] == [21, 64, 21, 64]
    kv = kv_of(llm)
    assert kv.window.num_blocks == 21 and kv.num_blocks == 64

    # Sized from memory (4 sequences of 80 tokens: 80 blocks a layer), the two sliding layers' spare
    # 80 - 21 blocks go to the two full layers.
    sized = make_llm(model, num_blocks=None).engine.executor.runner.window_group
    assert sized is not None
    assert (sized.num_window_blocks, sized.num_full_blocks) == (21, 80 + 80 - 21)


def test_greedy_through_chunks_and_preemption(model: TinyModel) -> None:
    # 30 full blocks (21 for the window group) for four requests growing to 29-65 tokens (46 blocks
    # of 4 without releasing): some are preempted, both tables freed, and recomputed.
    llm = make_llm(model, num_blocks=30)
    kv = kv_of(llm)
    assert kv.window.num_blocks == 21
    batch = prompts((5, 12, 23, 41), seed=3)  # 23 and 41 prefill in several chunks
    outputs = llm.generate(as_inputs(batch), greedy(24), use_tqdm=False)
    assert llm.engine.kv_stats()["num_preemptions"] > 0
    for prompt, output in zip(batch, outputs):
        assert output.outputs[0].token_ids == model.greedy(prompt, 24), f"prompt of {len(prompt)}"
    kv.check_integrity()
    assert kv.all_free_or_cached()


def test_prefix_cache_hit_resumes_both_groups(model: TinyModel) -> None:
    llm = make_llm(model)
    kv = kv_of(llm)
    longest = prompts((41,), seed=3)[0]
    assert llm.generate(as_inputs([longest]), greedy(12), use_tqdm=False)[0].outputs[0].token_ids == (
        model.greedy(longest, 12)
    )
    assert kv.window.radix.cached_blocks == 41 // BLOCK  # the prompt's blocks, in the window tree too
    shared = longest[:36] + [7, 8, 9, 10, 11]  # 36 tokens (9 blocks) cached in both groups
    again = llm.generate(as_inputs([shared]), greedy(12), use_tqdm=False)[0]
    assert again.num_cached_tokens == 36
    assert again.outputs[0].token_ids == model.greedy(shared, 12)
    kv.check_integrity()
    assert kv.all_free_or_cached()


def test_long_decode_returns_window_blocks(model: TinyModel) -> None:
    llm = make_llm(model, enable_prefix_caching=False)
    kv = kv_of(llm)
    prompt = prompts((20,), seed=5)[0]
    engine = llm.engine
    engine.add_request(EngineCoreRequest(request_id="a", prompt_token_ids=prompt, sampling_params=greedy(50)))
    tokens: list[int] = []
    peak_window, peak_full = 0, 0
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            tokens.extend(output.new_token_ids)
        if kv.has_allocation("a"):
            held = kv.num_window_held_blocks("a")
            peak_window, peak_full = max(peak_window, held), max(peak_full, kv.num_held_blocks("a"))
            assert kv.window.pool.num_used == held  # the pool takes back what the request released
            assert kv.window.stats()["free_blocks"] == kv.window.num_blocks - held
    assert tokens == model.greedy(prompt, 50)
    # The full layers keep every position (68 computed when last seen: the final step frees it).
    assert peak_full == cdiv(20 + 50 - 2, BLOCK)
    assert peak_window <= MAX_HELD + 1  # the window, the block written, and a straddled boundary
    assert peak_full > 3 * peak_window
    kv.check_integrity()
    assert kv.all_free_or_cached()
    assert kv.pool.num_free == kv.num_blocks and kv.window.pool.num_free == kv.window.num_blocks


def test_speculative_decoding_composes(model: TinyModel) -> None:
    """n-gram speculative decoding over both groups: tokens stay greedy and every block comes back
    (trimming rejected drafts' slots in both groups is tested in tests/unit/test_window_group_kv.py)."""
    llm = make_llm(
        model, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    )
    kv = kv_of(llm)
    batch = [[9, 10, 11, 12] * 6, prompts((17,), seed=9)[0]]
    outputs = llm.generate(as_inputs(batch), greedy(20), use_tqdm=False)
    for prompt, output in zip(batch, outputs):
        assert output.outputs[0].token_ids == model.greedy(prompt, 20)
    assert llm.engine.kv_stats()["spec_num_draft_tokens"] > 0
    kv.check_integrity()
    assert kv.all_free_or_cached()


def test_window_tables_reach_a_worker_process(model: TinyModel) -> None:
    """The ``mp`` executor: the window group's table travels with each step (executor/plan_delta.py)."""
    llm = make_llm(model, executor_backend="mp", num_threads=1, enable_prefix_caching=False)
    try:
        kv = kv_of(llm)
        batch = prompts((30, 7), seed=12)
        outputs = llm.generate(as_inputs(batch), greedy(16), use_tqdm=False)
        for prompt, output in zip(batch, outputs):
            assert output.outputs[0].token_ids == model.greedy(prompt, 16)
        assert kv.window.num_blocks == 21
        assert kv.all_free_or_cached()
    finally:
        llm.engine.executor.shutdown()
