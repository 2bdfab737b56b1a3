"""Speculative decoding with DeepSeek-V3's multi-token-prediction layer (``method: "mtp"``).

The tiny DeepSeek-V3 of ``test_deepseek_v3.py`` gets an MTP layer written into its checkpoint as
``model.layers.3.*`` (DeepSeek's layout). With a random MTP layer most drafts are rejected; greedy
tokens must still be transformers'. With a "bigram" model (every attention output and feed-forward
down projection zeroed, so the next token depends on the current one only) and an MTP layer that
passes the next token's embedding straight through to the shared head, the MTP layer predicts exactly
what the model will say: drafts are accepted, and the tokens are still transformers'.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import TinyModel, save_tiny_model
from tests.models.test_deepseek_v3 import DEEPSEEK_SPECS, make_llm
from tests.models.test_llama_family import as_inputs, greedy, tiny_prompts
from tokenmill import LLM

NUM_NEW = 16
NUM_LAYERS = 3
HIDDEN = 64


def _add_mtp_layer(folder: str, *, passthrough: bool) -> None:
    """Write an MTP layer as ``model.layers.{NUM_LAYERS}``: its decoder block a copy of the last
    layer's (random), or with ``passthrough`` an identity on the next token's embedding."""
    path = f"{folder}/model.safetensors"
    state = load_file(path)
    prefix, source = f"model.layers.{NUM_LAYERS}.", f"model.layers.{NUM_LAYERS - 1}."
    generator = torch.Generator().manual_seed(7)
    for name, tensor in list(state.items()):
        if name.startswith(source):
            state[prefix + name.removeprefix(source)] = tensor.clone()
    if passthrough:
        eh_proj = torch.cat(
            [torch.eye(HIDDEN), torch.zeros(HIDDEN, HIDDEN)], dim=1
        )  # [H, 2H]: embedding only
        enorm, hnorm = torch.ones(HIDDEN), torch.ones(HIDDEN)
        head_norm = state["model.norm.weight"].clone()
    else:
        eh_proj = torch.randn(HIDDEN, 2 * HIDDEN, generator=generator) * 3 / (2 * HIDDEN) ** 0.5
        enorm, hnorm, head_norm = (1 + 0.2 * torch.randn(HIDDEN, generator=generator) for _ in range(3))
    state[prefix + "eh_proj.weight"] = eh_proj
    state[prefix + "enorm.weight"] = enorm
    state[prefix + "hnorm.weight"] = hnorm
    state[prefix + "shared_head.norm.weight"] = head_norm
    state[prefix + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    state[prefix + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, path)


@pytest.fixture(scope="module", params=["random-mtp", "bigram-passthrough"])
def mtp_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    folder = str(tmp_path_factory.mktemp(f"tiny-deepseek-{request.param}"))
    hf = save_tiny_model(DEEPSEEK_SPECS["q-lora-yarn"], seed=71, folder=folder)
    passthrough = request.param == "bigram-passthrough"
    if passthrough:
        with torch.no_grad():
            for name, parameter in hf.named_parameters():
                if "o_proj" in name or "down_proj" in name:
                    parameter.zero_()
        hf.save_pretrained(folder)
    hf.generation_config.eos_token_id = None
    _add_mtp_layer(folder, passthrough=passthrough)
    return TinyModel(arch=request.param, path=folder, hf=hf)


def mtp_llm(model: TinyModel, **kwargs: Any) -> LLM:
    spec = {"method": "mtp", "num_speculative_tokens": 3, "draft_confidence": 0.0, "adaptive": False}
    return make_llm(model, speculative_config=spec, **kwargs)


def test_mtp_drafts_keep_greedy_tokens_exact(mtp_model: TinyModel) -> None:
    llm = mtp_llm(mtp_model)
    prompts = tiny_prompts()
    outputs = llm.generate(as_inputs(prompts), greedy(NUM_NEW), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [mtp_model.greedy(p, NUM_NEW) for p in prompts]
    stats = llm.kv_stats()
    assert stats["spec_num_draft_tokens"] > 0, stats
    if mtp_model.arch == "bigram-passthrough":
        # The layer predicts what the model says: (nearly) every draft is accepted.
        assert stats["spec_num_accepted_tokens"] >= 0.9 * stats["spec_num_draft_tokens"], stats
    # Prefix-cache hits (no target hidden states for the cached prefix) and preemption keep it exact.
    again = llm.generate(as_inputs(prompts[3:]), greedy(NUM_NEW), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [mtp_model.greedy(p, NUM_NEW) for p in prompts[3:]]
    assert all(o.num_cached_tokens > 0 for o in again)
    tight = mtp_llm(mtp_model, num_blocks=16)
    outputs = tight.generate(as_inputs(prompts), greedy(NUM_NEW), use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in outputs] == [mtp_model.greedy(p, NUM_NEW) for p in prompts]


def test_mtp_reads_the_targets_final_hidden_states(mtp_model: TinyModel, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The hidden states the layer reads at its first step are transformers' final (normed) hidden
    states of the prompt, assembled from the three chunks a 41-token prompt is prefilled in."""
    from tokenmill.worker.mtp_proposer import MTPProposer

    seen: list[torch.Tensor] = []
    original = MTPProposer._run

    def spy(self, steps, previous):  # type: ignore[no-untyped-def]
        seen.append(previous.clone())
        return original(self, steps, previous)

    monkeypatch.setattr(MTPProposer, "_run", spy)
    prompt = tiny_prompts()[-1]
    llm = mtp_llm(mtp_model, enable_prefix_caching=False)
    llm.generate(as_inputs([prompt]), greedy(2), use_tqdm=False)
    with torch.no_grad():
        expected = mtp_model.hf.model(torch.tensor([prompt])).last_hidden_state[0]  # [41, hidden]
    assert seen[0].shape == expected.shape
    torch.testing.assert_close(seen[0], expected, atol=1e-4, rtol=1e-4)


def test_mtp_without_the_layer_is_a_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    folder = str(tmp_path / "no-mtp")
    save_tiny_model(DEEPSEEK_SPECS["q-proj-plain-rope"], seed=3, folder=folder)
    model = TinyModel(arch="no-mtp", path=folder, hf=None)
    with pytest.raises(ValueError, match="multi-token-prediction layer 3 is missing or incomplete"):
        mtp_llm(model)
    config = json.loads((tmp_path / "no-mtp" / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0
    (tmp_path / "no-mtp" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="this checkpoint has no multi-token-prediction layer"):
        mtp_llm(model)


def test_mtp_on_a_model_without_mtp_layers_names_it(tiny_model) -> None:  # type: ignore[no-untyped-def]
    llama = tiny_model("llama")
    with pytest.raises(ValueError, match="'mtp' needs a native model with multi-token-prediction layers"):
        LLM(llama.path, dtype="float32", num_blocks=32, speculative_config={"method": "mtp"})
