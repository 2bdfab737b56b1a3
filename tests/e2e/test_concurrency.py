"""Many streams at once, and clients that walk away mid-stream."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
from server_process import ServerProcess, wait_until
from tiny_model import words

NUM_CLIENTS = 32


def test_32_concurrent_streams_match_greedy_answers(tiny_server: ServerProcess) -> None:
    prompts = [words([10 + i, 50 + i, 90 + (i * 7) % 100, 150 + i]) for i in range(NUM_CLIENTS)]
    common = {"model": "tiny", "max_tokens": 12, "temperature": 0, "ignore_eos": True}

    async def one_reference(http: httpx.AsyncClient, prompt: str) -> str:
        response = await http.post("/v1/completions", json={**common, "prompt": prompt})
        response.raise_for_status()
        return str(response.json()["choices"][0]["text"])

    async def one_stream(http: httpx.AsyncClient, prompt: str) -> tuple[str, str | None, bool]:
        text, finish, done = "", None, False
        async with http.stream(
            "POST", "/v1/completions", json={**common, "prompt": prompt, "stream": True}
        ) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line:
                    continue
                payload = line.removeprefix("data: ")
                if payload == "[DONE]":
                    done = True
                    continue
                choice = json.loads(payload)["choices"][0]
                text += choice["text"]
                finish = choice["finish_reason"] or finish
        return text, finish, done

    async def run() -> tuple[list[str], list[tuple[str, str | None, bool]]]:
        limits = httpx.Limits(max_connections=NUM_CLIENTS)
        async with httpx.AsyncClient(
            base_url=tiny_server.base_url, headers=tiny_server.headers, timeout=120, limits=limits
        ) as http:
            references = await asyncio.gather(*(one_reference(http, p) for p in prompts))
            streams = await asyncio.gather(*(one_stream(http, p) for p in prompts))
        return list(references), list(streams)

    references, streams = asyncio.run(run())
    assert len(set(references)) == NUM_CLIENTS  # distinct prompts, distinct answers: nothing mixed up
    for reference, (text, finish, done) in zip(references, streams):
        assert text == reference
        assert finish == "length" and done
    kv = tiny_server.kv()
    assert kv["all_free_or_cached"] and kv["num_running"] == 0


def test_disconnected_stream_frees_its_blocks(tiny_server: ServerProcess) -> None:
    assert tiny_server.kv()["blocks_in_use"] == 0
    payload = {
        "model": "tiny",
        "prompt": words([7, 8, 9]),
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with contextlib.ExitStack() as frozen:
        with tiny_server.http() as http, http.stream("POST", "/v1/completions", json=payload) as response:
            lines = response.iter_lines()
            received = [line for line, _ in zip(lines, range(6)) if line]
            assert received and received[0].startswith("data: ")
            # Frozen in place while it is inspected and disconnected.
            frozen.enter_context(tiny_server.paused_in_place())
            kv = tiny_server.kv()
            assert kv["num_running"] == 1 and kv["blocks_in_use"] > 0
            assert tiny_server.metric("tokenmill:num_requests_running") == 1
            assert tiny_server.metric("tokenmill:kv_cache_usage_perc") > 0
        # The connection is closed: the server must abort the request and give its blocks back (the
        # abort reaches a paused engine).
        wait_until(lambda: tiny_server.kv()["num_running"] == 0)
        kv = tiny_server.kv()
        assert kv["blocks_in_use"] == 0 and kv["all_free_or_cached"]
        wait_until(lambda: tiny_server.metric("tokenmill:num_requests_running") == 0)
        assert tiny_server.metric("tokenmill:kv_cache_usage_perc") == 0


def test_disconnected_non_streaming_request_is_aborted(tiny_server: ServerProcess) -> None:
    payload = {"model": "tiny", "prompt": words([7, 8, 9]), "max_tokens": 3000, "ignore_eos": True}

    async def run() -> None:
        async with tiny_server.async_http() as http:
            request = asyncio.ensure_future(http.post("/v1/completions", json=payload))
            while (await http.get("/v1/admin/kv")).json()["num_running"] == 0:
                await asyncio.sleep(0.01)  # polling for the request to start, bounded by the test timeout
            request.cancel()  # closes the connection mid-request
            await asyncio.gather(request, return_exceptions=True)

    asyncio.run(asyncio.wait_for(run(), 60))
    wait_until(lambda: tiny_server.kv()["num_running"] == 0)
    assert tiny_server.kv()["all_free_or_cached"]
