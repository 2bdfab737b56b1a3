"""Every client-side error path, in OpenAI's error shape, and that the server keeps serving after each."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_process import API_KEY, ServerProcess
from tiny_model import words

PROMPT = words([5, 6, 7, 8])


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return dict(error)


@pytest.fixture
def http(tiny_server: ServerProcess) -> Iterator[httpx.Client]:
    with tiny_server.http() as client:
        yield client
    # One bad request never affects others: the server still answers normally afterwards.
    with tiny_server.http() as client:
        ok = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert ok.status_code == 200


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"prompt": PROMPT, "temperature": "hot"}, "temperature"),
        ({"prompt": PROMPT, "temperature": 5}, "temperature"),
        ({"prompt": PROMPT, "top_p": 0}, "top_p"),
        ({"prompt": PROMPT, "max_tokens": -1}, "max_tokens"),
        ({"prompt": PROMPT, "n": 0}, "n"),
        ({"prompt": PROMPT, "logit_bias": {"abc": 1}}, "logit_bias"),
        (
            {"prompt": PROMPT, "logit_bias": {"100000": 1}},
            None,
        ),  # out of the vocabulary: refused by the engine
        ({"prompt": PROMPT, "min_tokens": 9, "max_tokens": 2}, "min_tokens"),
        ({"prompt": PROMPT, "frobnicate": True}, "frobnicate"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": PROMPT, "suffix": "x"}, "suffix"),
    ],
)
def test_completion_validation_names_the_field(
    http: httpx.Client, payload: dict[str, Any], param: str | None
) -> None:
    error = error_of(http.post("/v1/completions", json=payload), 400)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
        assert param in error["message"]


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages.0.content.0",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
            "response_format",
        ),
    ],
)
def test_chat_validation_names_the_field(http: httpx.Client, payload: dict[str, Any], param: str) -> None:
    error = error_of(http.post("/v1/chat/completions", json=payload), 400)
    assert error["param"] == param


def test_invalid_json_is_a_400(http: httpx.Client) -> None:
    response = http.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    error_of(response, 400)


def test_context_length_gives_both_numbers(http: httpx.Client, tiny_server: ServerProcess) -> None:
    max_model_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    too_long = http.post("/v1/completions", json={"prompt": [5] * (max_model_len + 10), "max_tokens": 1})
    error = error_of(too_long, 400)
    assert error["code"] == "context_length_exceeded"
    assert str(max_model_len) in error["message"] and str(max_model_len + 10) in error["message"]
    with_output = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": max_model_len})
    error = error_of(with_output, 400)
    assert str(max_model_len) in error["message"] and str(max_model_len + 4) in error["message"]
    client = tiny_server.client()
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "<5> " * max_model_len}], max_tokens=1
        )
    assert raised.value.code == "context_length_exceeded"


def test_unknown_model_and_route_are_404(http: httpx.Client, tiny_server: ServerProcess) -> None:
    error = error_of(http.post("/v1/completions", json={"model": "gpt-9", "prompt": PROMPT}), 404)
    assert error["code"] == "model_not_found" and "gpt-9" in error["message"]
    error_of(http.get("/v1/models/gpt-9"), 404)
    error_of(http.get("/v1/nothing-here"), 404)
    with pytest.raises(openai.NotFoundError):
        tiny_server.client().chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "x"}]
        )


def test_api_key_is_required_everywhere_but_health(tiny_server: ServerProcess) -> None:
    with httpx.Client(base_url=tiny_server.base_url, timeout=30) as anonymous:
        assert anonymous.get("/health").status_code == 200
        for method, path in [
            ("GET", "/v1/models"),
            ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"),
            ("POST", "/tokenize"),
            ("GET", "/metrics"),
            ("GET", "/version"),
            ("GET", "/v1/admin/kv"),
            ("POST", "/reset_prefix_cache"),
            ("GET", "/no-such-route"),
        ]:
            error = error_of(anonymous.request(method, path, json={}), 401)
            assert error["code"] == "invalid_api_key"
        wrong = anonymous.get("/v1/models", headers={"Authorization": "Bearer not-" + API_KEY})
        error_of(wrong, 401)
    wrong_client = openai.OpenAI(base_url=tiny_server.url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_client.models.list()


def test_oversized_body_is_413(http: httpx.Client) -> None:
    big = {"prompt": "<5> " * 300_000, "max_tokens": 1}  # ~1.2 MB against a 1 MB limit
    error = error_of(http.post("/v1/completions", json=big), 413)
    assert error["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the size is only known while reading
        yield b'{"prompt": "'
        for _ in range(300):
            yield b"<5> " * 1000
        yield b'", "max_tokens": 1}'

    error_of(
        http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413
    )
