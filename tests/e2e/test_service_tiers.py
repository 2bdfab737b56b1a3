"""Service tiers, per-user fairness and overload control through the real server.

One server of its own: one sequence runs at a time (so the order requests run in is the order they
finish in, which the server's request log records), ``--policy vtc``, two API keys (two users when
a request names none), and a ``flex`` tier whose waiting queue holds one request.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import httpx
import openai
import pytest
from server_process import API_KEY, TINY_ARGS, ServerProcess, wait_for_engine
from tiny_model import words

SECOND_KEY = "second-key-456"
PROMPT = words([5, 6, 7, 8])
LONG = {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True}


@pytest.fixture(scope="module")
def tier_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log_path = tmp_path_factory.mktemp("tier-server-log") / "server.log"
    args = [
        *TINY_ARGS,
        "--max-num-seqs", "1",
        "--policy", "vtc",
        "--tier", "priority",
        "--tier", "default",
        "--tier", "flex:max_waiting=1",
        "--api-key", SECOND_KEY,
        "--served-model-name", "tiny",
        "--log-level", "info",
    ]  # fmt: skip
    server = ServerProcess(tiny_model_dir, args, api_key=API_KEY, log_path=str(log_path))
    yield server
    server.stop()


def run(coroutine: object, timeout: float = 60.0) -> None:
    asyncio.run(asyncio.wait_for(coroutine, timeout))  # type: ignore[arg-type]


def test_the_tier_used_is_echoed(tier_server: ServerProcess) -> None:
    client = tier_server.client()
    messages = [{"role": "user", "content": "<5> <6>"}]
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=2, service_tier="priority"
    )  # type: ignore[arg-type]
    assert chat.service_tier == "priority"
    auto = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, service_tier="auto")  # type: ignore[arg-type]
    assert auto.service_tier == "default"
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert plain.model_extra is not None and plain.model_extra["service_tier"] == "default"
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=3,
            stream=True,
            service_tier="flex",  # type: ignore[arg-type]
        )
    )
    assert chunks and all(chunk.service_tier == "flex" for chunk in chunks)
    with tier_server.http() as http:
        with http.stream(
            "POST",
            "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 3, "stream": True, "service_tier": "flex"},
        ) as response:
            events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
        assert events[-1] == "[DONE]"
        assert all(json.loads(event)["service_tier"] == "flex" for event in events[:-1])
        refused = http.post("/v1/completions", json={"prompt": PROMPT, "service_tier": "gold"})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "service_tier" and "'gold' is not offered" in error["message"]
        metrics = http.get("/metrics").text
    assert re.search(
        r'tokenmill:time_to_first_token_seconds_count\{[^}]*service_tier="priority"\} [1-9]', metrics
    )
    assert re.search(
        r'tokenmill:time_to_first_token_seconds_count\{[^}]*service_tier="flex"\} [1-9]', metrics
    )


def test_a_full_tier_queue_is_429_with_retry_after_and_other_tiers_still_queue(
    tier_server: ServerProcess,
) -> None:
    flex = {"prompt": PROMPT, "max_tokens": 2, "service_tier": "flex"}

    async def scenario() -> None:
        async with tier_server.async_http() as http:
            async with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as running:
                assert running.status_code == 200
                # Frozen in place while the queues fill: the long request holds the seat throughout (it
                # would otherwise end in ~3 s, which a loaded machine's client calls can outlast).
                await wait_for_engine(http, "num_running", 1)
                with tier_server.paused_in_place():
                    waiting = asyncio.ensure_future(http.post("/v1/completions", json=flex))
                    await wait_for_engine(http, "num_waiting_flex", 1)
                    refused = await http.post("/v1/completions", json=flex)
                    assert refused.status_code == 429
                    assert int(refused.headers["Retry-After"]) >= 1
                    error = refused.json()["error"]
                    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
                    assert "'flex' service tier is overloaded" in error["message"]
                    with pytest.raises(openai.RateLimitError):
                        await tier_server.async_client().completions.create(
                            model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"service_tier": "flex"}
                        )
                    # The default tier's queue is not full: it still takes work.
                    default = asyncio.ensure_future(
                        http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
                    )
                    await wait_for_engine(http, "num_waiting", 2)
            for answered in (await waiting, await default):
                assert answered.status_code == 200
        metrics = httpx.get(f"{tier_server.base_url}/metrics", headers=tier_server.headers).text
        assert re.search(
            r'tokenmill:num_requests_overloaded_total\{[^}]*service_tier="flex"\} [2-9]', metrics
        )

    run(scenario())


def test_deadlines_end_waiting_and_running_requests_and_free_their_blocks(tier_server: ServerProcess) -> None:
    async def scenario() -> None:
        async with tier_server.async_http() as http:
            async with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as running:
                assert running.status_code == 200
                await wait_for_engine(http, "num_running", 1)
                # It never gets the seat: its deadline ends it while it waits, with no output.
                waited = await http.post(
                    "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "timeout": 0.3}
                )
            # Closing the long stream frees the seat; this one starts and is cut off by its deadline.
            cut = await http.post("/v1/completions", json={**LONG, "timeout": 0.5})
            for response, has_text in ((waited, False), (cut, True)):
                assert response.status_code == 200
                choice = response.json()["choices"][0]
                assert (choice["finish_reason"], choice["stop_reason"]) == ("length", "timeout")
                completion_tokens = response.json()["usage"]["completion_tokens"]
                assert (completion_tokens > 0) == has_text and completion_tokens < 4000
            kv = (await http.get("/v1/admin/kv")).json()
            assert kv["all_free_or_cached"] and kv["num_running"] == 0 and kv["num_waiting"] == 0
        log = tier_server.log()
        assert re.search(r"finished \(timeout\).*output_tokens=0 ", log)

    run(scenario())


def test_a_light_user_is_served_ahead_of_a_heavy_users_queued_flood(tier_server: ServerProcess) -> None:
    """The flood comes with the first key, the light user with the second and no ``user`` field:
    API keys identify users. One sequence runs at a time, so requests finish in the order they
    ran. A long flood request holds the seat while three more queue, then the light user's two
    requests queue; the long one keeps generating (at least 40 more chunks, so the heavy user's
    counter passes the light user's, which was lifted to it on arrival) and is then aborted. VTC
    runs the light user's requests next, ahead of the flood's queue (FCFS would run them last)."""
    light_headers = {"Authorization": f"Bearer {SECOND_KEY}"}
    short_flood = {"prompt": PROMPT, "max_tokens": 20, "ignore_eos": True}

    async def scenario() -> list[str]:
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(
            base_url=tier_server.base_url, headers=tier_server.headers, timeout=60, limits=limits
        ) as http:
            await wait_for_engine(http, "num_running", 0)
            chunks = [0]
            async with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as long_flood:
                assert long_flood.status_code == 200

                async def count_chunks() -> None:
                    async for line in long_flood.aiter_lines():
                        chunks[0] += line.startswith("data: {")

                counting = asyncio.ensure_future(count_chunks())
                await wait_for_engine(http, "num_running", 1)
                floods = [
                    asyncio.ensure_future(http.post("/v1/completions", json=short_flood)) for _ in range(3)
                ]
                await wait_for_engine(http, "num_waiting", 3)
                light = [
                    asyncio.ensure_future(
                        http.post(
                            "/v1/completions",
                            json={"prompt": words([9, 10, k]), "max_tokens": 2},
                            headers=light_headers,
                        )
                    )
                    for k in (11, 12)
                ]
                await wait_for_engine(http, "num_waiting", 5)
                seen = chunks[0]
                while chunks[0] < seen + 40:
                    await asyncio.sleep(0.01)
                counting.cancel()
            answers = await asyncio.gather(*light)
            for answer in [*answers, *(await asyncio.gather(*floods))]:
                assert answer.status_code == 200
        return [answer.json()["id"] for answer in answers]

    log_before = len(tier_server.log())
    result: list[list[str]] = []

    async def collect() -> None:
        result.append(await scenario())

    run(collect(), timeout=120)
    light_ids = result[0]
    finished = re.findall(
        r"request (\S+) finished \((\w+)\): .*output_tokens=(\d+) ", tier_server.log()[log_before:]
    )
    order = [
        ("light" if request_id in light_ids else f"flood {reason}") for request_id, reason, _ in finished
    ]
    assert order == ["flood abort", "light", "light", "flood length", "flood length", "flood length"]
