"""gpt-oss's harmony format through a real server: reasoning and tool calls, streamed and not.

The served model is a tiny gpt-oss, run by our native ``GptOssForCausalLM`` (sinks, sliding layers and
experts all computed), with the scripted model's weights (``scripted_model.py``) carried over: the
attention and expert outputs are zero (weights and biases), so the residual stream is the token's
one-hot embedding and the LM head maps each token to its successor in a script. Its channel markup
tokens are special tokens of its tokenizer, as in gpt-oss's, so the server must keep special tokens in
the text for the parsers (``--reasoning-parser openai_gptoss --tool-call-parser openai``) to see them.
A first-order script cannot repeat a token, so each token carries a whole run of markup
(``<|end|><|start|>assistant<|channel|>final<|message|>``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from scripted_model import CHAT_TEMPLATE, build_scripted_model
from server_process import TINY_ARGS, ServerProcess
from test_tool_calls import TOOLS, _collect
from transformers import AutoTokenizer

MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
SCRIPTS = {
    "sum?": [
        "<|channel|>analysis<|message|>",
        "User",
        "wants",
        "2+2.",
        "<|end|><|start|>assistant<|channel|>final<|message|>",
        "It",
        "is",
        "4.",
        "<|return|>",
    ],
    "weather?": [
        "<|channel|>analysis <|message|>",
        "Need",
        "the",
        "weather.",
        "<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
        '{"city":',
        '"Paris"}',
        "<|call|>",
        "Hallucinated",  # what a model goes on with if <|call|> does not end the turn
        "result.",
    ],
}
SPECIAL = [piece for pieces in SCRIPTS.values() for piece in pieces if "<|" in piece]


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = str(tmp_path_factory.mktemp("harmony-scripted"))
    build_scripted_model(path, SCRIPTS)
    _as_gpt_oss(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    # The script's markup tokens (same ids) and the bare markers become special tokens.
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL + MARKERS})
    assert tokenizer.convert_tokens_to_ids(SPECIAL[0]) < 64  # kept its id: the model's vocabulary
    # As gpt-oss's template, this one writes the request's reasoning_effort (two more prompt tokens).
    tokenizer.chat_template = (
        "{% if reasoning_effort is defined %}effort {{ reasoning_effort }} {% endif %}" + (CHAT_TEMPLATE)
    )
    tokenizer.save_pretrained(path)
    args = [
        *TINY_ARGS,
        "--served-model-name",
        "scripted",  # the name test_tool_calls._collect asks for
        "--reasoning-parser",
        "openai_gptoss",
        "--tool-call-parser",
        "openai",
    ]
    log_path = str(tmp_path_factory.mktemp("harmony-log") / "server.log")
    server = ServerProcess(path, [*args, "--log-level", "info"], log_path=log_path)
    assert "native implementation: native GptOssForCausalLM" in server.log()
    yield server
    server.stop()


def _as_gpt_oss(path: str) -> None:
    """Replace the scripted Llama in ``path`` by a gpt-oss computing the same script."""
    import torch
    from safetensors.torch import load_file
    from transformers import GptOssConfig, GptOssForCausalLM

    llama = load_file(f"{path}/model.safetensors")
    head = llama["lm_head.weight"]  # [vocab, hidden]: token i's column puts the margin on its successor
    size = head.shape[0]
    config = GptOssConfig(
        vocab_size=size,
        hidden_size=size,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        max_position_embeddings=2048,
        eos_token_id=1,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "o_proj" in name or "experts.down_proj" in name:
                param.zero_()  # weights and biases: the layers add nothing to the residual stream
        model.model.embed_tokens.weight.copy_(torch.eye(size))
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.copy_(head)
    model.save_pretrained(path)


def _ask(cue: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"please answer {cue}"}]


def test_reasoning_and_final_channels_separate(harmony_server: ServerProcess) -> None:
    response = harmony_server.client().chat.completions.create(
        model="scripted", messages=_ask("sum?"), max_tokens=30
    )  # type: ignore[arg-type]
    [choice] = response.choices
    assert choice.message.model_extra["reasoning_content"] == "User wants 2+2."
    assert choice.message.content == "It is 4."
    assert choice.finish_reason == "stop"
    # Streamed: the same split, reasoning deltas before any content.
    with harmony_server.client().chat.completions.create(
        model="scripted", messages=_ask("sum?"), max_tokens=30, stream=True
    ) as stream:  # type: ignore[arg-type]
        reasoning, content, kinds = "", "", []
        for chunk in stream:
            for streamed in chunk.choices:
                delta = streamed.delta
                if (delta.model_extra or {}).get("reasoning_content"):
                    reasoning += delta.model_extra["reasoning_content"]
                    kinds.append("reasoning")
                if delta.content:
                    content += delta.content
                    kinds.append("content")
    assert (reasoning, content) == ("User wants 2+2.", "It is 4.")
    assert kinds.index("content") > max(i for i, k in enumerate(kinds) if k == "reasoning")
    assert not any("<|" in text for text in (reasoning, content))


def test_harmony_tool_call(harmony_server: ServerProcess) -> None:
    response = harmony_server.client().chat.completions.create(
        model="scripted", messages=_ask("weather?"), tools=TOOLS, max_tokens=30
    )  # type: ignore[arg-type]
    [choice] = response.choices
    assert choice.finish_reason == "tool_calls"
    # <|call|> (not an EOS in gpt-oss's config) stopped the turn: the script up to it, nothing after.
    assert response.usage.completion_tokens == SCRIPTS["weather?"].index("<|call|>") + 1
    assert choice.message.model_extra["reasoning_content"] == "Need the weather."
    assert choice.message.content is None
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    state = _collect(harmony_server, "weather?")["choices"][0]
    assert state["reasoning"] == "Need the weather." and state["content"] == ""
    assert [(c["name"], c["arguments"]) for c in state["calls"]] == [("get_weather", '{"city": "Paris"}')]
    assert state["finish"] == "tool_calls"


def test_reasoning_effort_reaches_the_template(harmony_server: ServerProcess) -> None:
    client = harmony_server.client()
    plain = client.chat.completions.create(model="scripted", messages=_ask("sum?"), max_tokens=30)  # type: ignore[arg-type]
    high = client.chat.completions.create(
        model="scripted",
        messages=_ask("sum?"),
        max_tokens=30,
        reasoning_effort="high",  # type: ignore[arg-type]
    )
    assert high.usage.prompt_tokens == plain.usage.prompt_tokens + 2
    assert high.choices[0].message.content == "It is 4."
    with harmony_server.http() as http:
        body = {"model": "scripted", "messages": _ask("sum?"), "reasoning_effort": "extreme"}
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert "reasoning_effort must be one of low, medium, high" in response.json()["error"]["message"]
