"""Tools under a LoRA adapter in a live SmolLM2 server: a forced tool choice (the JSON-schema grammar
of ``server/serving_tools.py``) makes the adapter's answer a call that parses and fits the tools'
schemas, streamed and not, with a service tier and a user for the fair scheduler on the request."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from server_process import ServerProcess
from test_tool_choice_enforced import MESSAGES, TOOLS, _both_ways

from tests.models.lora_adapters import make_adapter


@pytest.fixture(scope="module")
def lora_smollm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from transformers import AutoModelForCausalLM

    from tests.models.test_llama_family import smollm2_gguf

    folder, name = smollm2_gguf()
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    adapter = make_adapter(
        hf, str(tmp_path_factory.mktemp("smol-tools-lora")), "tuned", seed=9, rank=16, scale=0.3
    )
    args = ["--log-level", "warning", "--max-model-len", "1024", "--num-threads", "1", "--policy", "vtc"]
    args += ["--enable-lora", "--lora-modules", f"tuned={adapter.path}", "--max-lora-rank", "16"]
    server = ServerProcess("smollm2-135m", args)
    yield server
    server.stop()


def _answer(server: ServerProcess, model: str) -> tuple[str, list[float]]:
    """The greedy answer and its tokens' logprobs."""
    response = server.client().chat.completions.create(
        model=model,
        messages=MESSAGES,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=24,
        logprobs=True,
    )
    choice = response.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    return choice.message.content or "", [entry.logprob for entry in choice.logprobs.content]


def test_forced_tool_calls_parse_under_an_adapter(lora_smollm_server: ServerProcess) -> None:
    server = lora_smollm_server
    # The adapter is applied: its answer, or at least its distribution, is not the base model's (a
    # weak adapter's greedy text can equal the base's in bfloat16; its logprobs cannot).
    (tuned, tuned_logprobs), (base, base_logprobs) = _answer(server, "tuned"), _answer(server, "smollm2-135m")
    if tuned == base:
        assert max(abs(a - b) for a, b in zip(tuned_logprobs, base_logprobs)) > 1e-2
    for model in ("tuned", "smollm2-135m"):
        named = _both_ways(
            server,
            model=model,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            extra_body={"service_tier": "flex", "user": f"user-{model}"},
        )
        assert [call_name for call_name, _ in named] == ["get_time"]
        required = _both_ways(server, model=model, tool_choice="required", parallel_tool_calls=False)
        assert len(required) == 1 and required[0][0] in {t["function"]["name"] for t in TOOLS}
