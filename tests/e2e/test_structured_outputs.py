"""Structured outputs through the server: OpenAI's response_format, vLLM's guided_* fields, and the
400s for constraints that cannot be enforced (each naming the field and the problem)."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from server_process import ServerProcess
from tiny_model import words

PROMPT = words([5, 6, 7, 8])
MESSAGES = [{"role": "user", "content": "hi"}]
MODEL = "smollm2-135m"


@pytest.mark.parametrize(
    ("route", "extra", "param", "message"),
    [
        ("completions", {"guided_json": "{oops"}, "guided_json", "invalid JSON schema: not valid JSON"),
        ("completions", {"guided_json": {"type": "strin"}}, "guided_json", 'Unsupported type "strin"'),
        ("completions", {"guided_regex": "[a-"}, "guided_regex", "invalid regex: Regex parsing error"),
        ("completions", {"guided_grammar": "root ::= x"}, "guided_grammar", 'Rule "x" is not defined'),
        ("completions", {"guided_choice": []}, "guided_choice", "choice must be a non-empty list"),
        (
            "completions",
            {"guided_json": {"type": "array", "uniqueItems": True}},
            "guided_json",
            "JSON schema keyword 'uniqueItems' at '/uniqueItems' cannot be enforced",
        ),
        (
            "completions",
            {"guided_regex": "a", "guided_choice": ["a"]},
            "guided_choice",
            "give at most one structured output constraint, got guided_regex, guided_choice",
        ),
        (
            "completions",
            {"guided_regex": "a", "ignore_eos": True},
            "ignore_eos",
            "ignore_eos cannot be combined with structured outputs",
        ),
        (
            "completions",
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one structured output constraint",
        ),
        (
            "chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                }
            },
            "response_format",
            'invalid JSON schema: Unsupported type "objekt"',
        ),
        (
            "chat/completions",
            {"response_format": {"type": "yaml"}},
            "response_format",
            "response_format type must be 'text', 'json_object' or 'json_schema', got 'yaml'",
        ),
        (
            "chat/completions",
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
            "got response_format, guided_regex",
        ),
    ],
)
def test_bad_constraints_are_400s_naming_the_problem(
    tiny_server: ServerProcess, route: str, extra: dict[str, Any], param: str, message: str
) -> None:
    body: dict[str, Any] = {"max_tokens": 4, **extra}
    body.update({"messages": MESSAGES} if route.startswith("chat") else {"prompt": PROMPT})
    with tiny_server.http() as http:
        response = http.post(f"/v1/{route}", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param
        assert message in error["message"]
        # The server goes on serving.
        assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "languages"],
}


def test_response_format_json_schema_validates_and_streams_identically(smollm_server: ServerProcess) -> None:
    client = smollm_server.client()
    messages = [{"role": "user", "content": "Describe a programmer as JSON with name, age and languages."}]
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    forced_before = smollm_server.metric("tokenmill:jump_forward_tokens_total")
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=120, temperature=0, response_format=response_format
    )  # type: ignore[call-overload]
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    assert smollm_server.metric("tokenmill:jump_forward_tokens_total") > forced_before
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=120,
        temperature=0,
        response_format=response_format,
        stream=True,
    )  # type: ignore[call-overload]
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_and_guided_fields(smollm_server: ServerProcess) -> None:
    client = smollm_server.client()
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": 'Repeat exactly this JSON object: {"city": "Paris", "country": "France"}',
            }
        ],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert answer.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(answer.choices[0].message.content or ""), dict)

    choices = ["Paris", "London", "Berlin"]
    completion = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=10,
        n=2,
        seed=1,
        extra_body={"guided_choice": choices},
    )
    assert [c.text for c in completion.choices if c.text in choices] == [c.text for c in completion.choices]
    with smollm_server.http() as http:
        response = http.post(
            "/v1/completions",
            json={"prompt": "My phone number is", "max_tokens": 20, "guided_regex": r"[0-9]{3}-[0-9]{4}"},
        )
    assert response.status_code == 200
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", choice["text"])
