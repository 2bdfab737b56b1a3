"""Speculative decoding through the server: ``tokenmill serve --speculative-config`` gives the same
greedy completions (plain and streamed) as a server without it and counts drafts in ``/metrics``
and ``/v1/admin/kv``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_process import API_KEY, TINY_ARGS, ServerProcess
from tiny_model import words

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}'
MOTIF = [17, 90, 33, 201, 5, 48, 77, 160]
PROMPTS = [MOTIF * 4, list(range(30, 60)), MOTIF + [9] + MOTIF[:3]]


@pytest.fixture(scope="module")
def spec_server(tiny_model_dir: str) -> Iterator[ServerProcess]:
    server = ServerProcess(
        tiny_model_dir,
        [*TINY_ARGS, "--served-model-name", "tiny", "--speculative-config", SPEC],
        api_key=API_KEY,
    )
    yield server
    server.stop()


def complete(server: ServerProcess, prompt: list[int], stream: bool = False) -> str:
    body = {"model": "tiny", "prompt": words(prompt), "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    if not stream:
        with server.http() as http:
            response = http.post("/v1/completions", json=body)
            response.raise_for_status()
            return str(response.json()["choices"][0]["text"])
    body.pop("ignore_eos")
    chunks = server.client().completions.create(  # type: ignore[call-overload]
        **body, stream=True, extra_body={"ignore_eos": True}
    )
    return "".join(chunk.choices[0].text for chunk in chunks)


def test_greedy_completions_are_the_same_with_and_without_speculation(
    spec_server: ServerProcess, tiny_server: ServerProcess
) -> None:
    for prompt in PROMPTS:
        expected = complete(tiny_server, prompt)
        assert complete(spec_server, prompt) == expected
        assert complete(spec_server, prompt, stream=True) == expected
    drafts = spec_server.metric("tokenmill:spec_decode_num_draft_tokens_total")
    accepted = spec_server.metric("tokenmill:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 <= accepted <= drafts
    kv = spec_server.kv()
    assert kv["spec_num_draft_tokens"] == drafts
    assert float(kv["spec_mean_accepted_length"]) >= 1.0  # type: ignore[arg-type]
    assert kv["all_free_or_cached"] is True
