"""Shared by the RL tests: two weight sets of one tiny Llama (A and B) and small helpers.

The fixtures are registered under the names ``weights_a`` and ``weights_b``; a test module imports
``fixture_weights_a`` and ``fixture_weights_b`` to make them available.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY_SPECS, TinyModel, _build_config, _build_tokenizer, spread_weights
from tokenmill import LLM, SamplingParams

PROMPT = [20, 31, 42, 53, 64, 75, 86, 97, 108]  # 9 tokens: two full blocks of 4 can be cached


@pytest.fixture(scope="module", name="weights_a")
def fixture_weights_a(tiny_model) -> TinyModel:  # type: ignore[no-untyped-def]
    return tiny_model("llama")  # type: ignore[no-any-return]


@pytest.fixture(scope="module", name="weights_b")
def fixture_weights_b(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The same architecture as ``weights_a`` with other weights, saved as a folder."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        _build_config(TINY_SPECS["llama"]), dtype=torch.float32
    ).eval()
    spread_weights(model, seed=99)
    model.generation_config.eos_token_id = None
    folder = tmp_path_factory.mktemp("tiny-llama-b")
    model.save_pretrained(folder)
    _build_tokenizer().save_pretrained(folder)
    return TinyModel(arch="llama", path=str(folder), hf=model)


def make_llm(model: TinyModel, **kwargs: object) -> LLM:
    return LLM(model.path, **{"dtype": "float32", "num_blocks": 64, "block_size": 4, "seed": 0, **kwargs})


def greedy(n: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run(llm: LLM, prompt: list[int] = PROMPT, n: int = 6) -> tuple[list[int], int]:
    out = llm.generate([{"prompt_token_ids": prompt}], greedy(n), use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def hf_state(model: TinyModel) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.hf.state_dict().items()}
