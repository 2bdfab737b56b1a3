"""Raw HTTP: the SSE wire format, the tokenizer routes, health, version and metrics."""

from __future__ import annotations

import json
from typing import Any

import httpx
from server_process import ServerProcess
from tiny_model import words

PROMPT = words([5, 6, 7, 8])


def read_events(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an SSE response, in order; events are separated by blank lines."""
    assert response.headers["content-type"].startswith("text/event-stream")
    body = response.read().decode()
    assert body.endswith("\n\n")
    events = [block for block in body.split("\n\n") if block]
    assert all(block.startswith("data: ") for block in events)
    return [block.removeprefix("data: ") for block in events]


def post_stream(server: ServerProcess, path: str, payload: dict[str, Any]) -> list[str]:
    with server.http() as http, http.stream("POST", path, json=payload) as response:
        assert response.status_code == 200
        return read_events(response)


def test_chat_sse_wire_format(tiny_server: ServerProcess) -> None:
    events = post_stream(
        tiny_server,
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
            "logit_bias": {"0": -100, "1": -100},  # special tokens decode to no text
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c["choices"][0]["delta"]["content"] for c in chunks[1:-2]]
    # Usually one token per delta; a client slower than the engine gets several merged into one.
    assert all(content) and len("".join(content).split()) == 5
    assert chunks[-2]["choices"][0]["delta"] == {}
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-1]["usage"]["total_tokens"] == chunks[-1]["usage"]["prompt_tokens"] + 5


def test_completion_sse_with_n_uses_index(tiny_server: ServerProcess) -> None:
    events = post_stream(
        tiny_server,
        "/v1/completions",
        {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "n": 2, "stream": True, "ignore_eos": True},
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and len(c["choices"]) == 1 for c in chunks)
    finishes = {
        c["choices"][0]["index"]: c["choices"][0]["finish_reason"]
        for c in chunks
        if c["choices"][0]["finish_reason"]
    }
    assert finishes == {0: "length", 1: "length"}
    assert all(c.get("usage") is None for c in chunks)  # no usage chunk unless asked


def test_tokenize_and_detokenize(tiny_server: ServerProcess) -> None:
    with tiny_server.http() as http:
        tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()
        assert tokens["tokens"] == [5, 6, 7, 8] and tokens["count"] == 4 and tokens["max_model_len"] > 0
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "<9>"}]}).json()
        assert chat["tokens"] == [2, 9, 3]  # the tiny chat template: <2> content <3>
        assert http.post("/detokenize", json={"tokens": [5, 6, 7, 8]}).json() == {"prompt": PROMPT}


def test_health_version_and_metrics(tiny_server: ServerProcess) -> None:
    with tiny_server.http() as http:
        assert http.get("/health").status_code == 200
        assert http.get("/version").json()["version"]
        http.post(
            "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True}
        ).raise_for_status()
        metrics = http.get("/metrics")
    assert metrics.status_code == 200
    text = metrics.text
    for name in (
        "tokenmill:num_requests_running",
        "tokenmill:num_requests_waiting",
        "tokenmill:kv_cache_usage_perc",
        "tokenmill:prompt_tokens_total",
        "tokenmill:generation_tokens_total",
        "tokenmill:num_preemptions_total",
        "tokenmill:time_to_first_token_seconds_bucket",
        "tokenmill:inter_token_latency_seconds_bucket",
        "tokenmill:e2e_request_latency_seconds_bucket",
    ):
        assert name in text, name
    generated = next(
        line for line in text.splitlines() if line.startswith("tokenmill:generation_tokens_total")
    )
    assert float(generated.rsplit(" ", 1)[1]) >= 3


def test_reset_prefix_cache(tiny_server: ServerProcess) -> None:
    with tiny_server.http() as http:
        http.post(
            "/v1/completions", json={"prompt": words(list(range(60, 80))), "max_tokens": 1}
        ).raise_for_status()
        assert tiny_server.kv()["cached_blocks"] > 0
        assert http.post("/reset_prefix_cache").json() == {"success": True}
    assert tiny_server.kv()["cached_blocks"] == 0


def test_one_log_line_per_request_without_text(tiny_server: ServerProcess) -> None:
    prompt = words([201, 202, 203, 204, 205])
    with tiny_server.http() as http:
        response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "ignore_eos": True})
        response.raise_for_status()
    request_id = response.json()["id"]
    completion = response.json()["choices"][0]["text"]
    log = tiny_server.log()
    lines = [line for line in log.splitlines() if request_id in line]
    assert len(lines) == 1, lines
    assert "prompt_tokens=5" in lines[0] and "output_tokens=3" in lines[0]
    assert "ttft=" in lines[0] and "e2e=" in lines[0]
    assert prompt not in log and completion.strip() not in log
