"""SGLang's and vLLM's extension fields on the OpenAI routes of the live tiny server: the body SGLang's
router sends, ``no_stop_trim``, ``rid``, ``regex``/``ebnf``, fields that are a 400, unknown fields."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from server_process import ServerProcess
from tiny_model import words

PROMPT = words([5, 6, 7, 8])
MESSAGES = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0, "ignore_eos": True}

# What sglang-router 0.3.2 forwards for `{"messages": ..., "max_tokens": 6}` (captured from it).
ROUTER_FIELDS = {
    "logprobs": False,
    "stream": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}


def post(server: ServerProcess, route: str, body: dict[str, Any]) -> httpx.Response:
    with server.http() as http:
        return http.post(f"/v1/{route}", json={"model": "tiny", **body})


def test_the_body_sglang_router_sends_is_answered_like_a_plain_one(tiny_server: ServerProcess) -> None:
    plain = post(tiny_server, "chat/completions", {"messages": MESSAGES, "max_tokens": 6, "temperature": 0})
    routed = post(
        tiny_server,
        "chat/completions",
        {"messages": MESSAGES, "max_completion_tokens": 6, **ROUTER_FIELDS, "temperature": 0},
    )
    assert plain.status_code == routed.status_code == 200, routed.text
    assert routed.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    assert "X-Ignored-Fields" not in routed.headers


def test_no_stop_trim_keeps_the_stop_string(tiny_server: ServerProcess) -> None:
    base = {"prompt": PROMPT, "max_tokens": 8, **GREEDY}
    full = post(tiny_server, "completions", base).json()["choices"][0]["text"]
    stop = full.split()[2]  # a word of the greedy continuation
    trimmed = post(tiny_server, "completions", {**base, "stop": [stop]}).json()["choices"][0]
    kept = post(tiny_server, "completions", {**base, "stop": [stop], "no_stop_trim": True}).json()["choices"][
        0
    ]
    assert trimmed["finish_reason"] == kept["finish_reason"] == "stop"
    assert not trimmed["text"].endswith(stop)
    assert kept["text"] == trimmed["text"] + stop


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_rid_is_the_request_id(tiny_server: ServerProcess, route: str) -> None:
    body: dict[str, Any] = {"max_tokens": 2, "rid": f"my-rid-{route}", **GREEDY}
    body.update({"messages": MESSAGES} if route.startswith("chat") else {"prompt": PROMPT})
    response = post(tiny_server, route, body)
    assert response.status_code == 200, response.text
    assert response.json()["id"] == f"my-rid-{route}"


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"regex": "[a-"}, "regex", "invalid regex"),
        ({"ebnf": "root ::= x"}, "ebnf", 'Rule "x" is not defined'),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf", "got regex, ebnf"),
        ({"lora_path": "adapter-1"}, "lora_path", "lora_path is not supported by this server"),
        ({"return_hidden_states": True}, "return_hidden_states", "return_hidden_states is not supported"),
        ({"use_beam_search": True}, "use_beam_search", "use_beam_search is not supported"),
        ({"rid": ""}, "rid", "rid must not be empty"),
        ({"frobnicate": 1}, "frobnicate", "frobnicate: unrecognized request argument"),
    ],
)
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_fields_that_cannot_be_honoured_are_400s(
    tiny_server: ServerProcess, route: str, extra: dict[str, Any], param: str, message: str
) -> None:
    body: dict[str, Any] = {"max_tokens": 2, **extra}
    body.update({"messages": MESSAGES} if route.startswith("chat") else {"prompt": PROMPT})
    response = post(tiny_server, route, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert message in error["message"]


def test_continue_final_message_needs_no_generation_prompt(tiny_server: ServerProcess) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "partial"}]
    both = post(tiny_server, "chat/completions", {"messages": messages, "continue_final_message": True})
    assert both.status_code == 400
    assert both.json()["error"]["param"] == "messages"
    ok = post(
        tiny_server,
        "chat/completions",
        {
            "messages": messages,
            "continue_final_message": True,
            "add_generation_prompt": False,
            "max_tokens": 2,
        },
    )
    assert ok.status_code == 200, ok.text
