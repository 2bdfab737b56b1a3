"""The prefix cache through the server: cached_tokens in usage, salts, metrics and identical outputs."""

from __future__ import annotations

from server_process import ServerProcess
from tiny_model import words

SHARED = list(range(20, 84))  # 64 tokens: several full blocks whatever the block size up to 64


def complete(server: ServerProcess, prompt_ids: list[int], **extra: object) -> dict:
    with server.http() as http:
        response = http.post(
            "/v1/completions",
            json={
                "prompt": words(prompt_ids),
                "max_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
                **extra,
            },
        )
        response.raise_for_status()
        return response.json()


def test_shared_prefix_is_reported_as_cached_and_changes_nothing(tiny_server: ServerProcess) -> None:
    with tiny_server.http() as http:
        assert http.post("/reset_prefix_cache").json() == {"success": True}
    hits_before = tiny_server.metric("tokenmill:prefix_cache_hits_total")
    first = complete(tiny_server, SHARED + [90, 91])
    second = complete(tiny_server, SHARED + [92, 93, 94])
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 48 and cached <= len(SHARED)
    assert tiny_server.metric("tokenmill:prefix_cache_hits_total") - hits_before == cached
    assert 0 < tiny_server.metric("tokenmill:prefix_cache_hit_rate") <= 1

    # The same prompt again is served (mostly) from the cache and gives the very same completion.
    again = complete(tiny_server, SHARED + [92, 93, 94])
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= cached
    assert again["choices"][0]["text"] == second["choices"][0]["text"]


def test_different_cache_salts_never_share(tiny_server: ServerProcess) -> None:
    prompt = list(range(100, 164))
    complete(tiny_server, prompt, cache_salt="alice")
    other = complete(tiny_server, prompt, cache_salt="bob")
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    same = complete(tiny_server, prompt, cache_salt="alice")
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert same["choices"][0]["text"] == other["choices"][0]["text"]
