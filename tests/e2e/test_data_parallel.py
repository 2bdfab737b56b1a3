"""``tokenmill serve --data-parallel-size 2``: two engine processes behind one server. Greedy outputs
equal a one-engine server's, both engines get work, same-prefix requests stay on one engine under
``cache_aware``, streaming works, per-replica gauges are in /metrics, and one engine's death is an
engine fault (503s, then the server exits with status 1, taking the other engine with it)."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_process import TINY_ARGS, ServerProcess, process_gone, wait_until

PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "hello world",
    "one two three four five six seven",
    "a b c d e f g h i j k l m n o p",
]
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 3


@pytest.fixture(scope="module")
def dp_server(tiny_model_dir: str) -> Iterator[ServerProcess]:
    args = [*TINY_ARGS, "--served-model-name", "tiny", "--data-parallel-size", "2"]
    server = ServerProcess(tiny_model_dir, [*args, "--engine-death-exit-delay", "5"])
    yield server
    server.stop()


def complete(server: ServerProcess, prompt: str, max_tokens: int = 8) -> str:
    with server.http() as http:
        response = http.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        )
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def replica_metric(server: ServerProcess, name: str) -> list[float]:
    with server.http() as http:
        text = http.get("/metrics").text
    found = re.findall(rf'^tokenmill:{name}\{{model_name="tiny",replica="(\d)"\}} (\S+)$', text, re.M)
    return [float(value) for _, value in sorted(found)]


def test_outputs_equal_one_engine_and_both_engines_serve(
    dp_server: ServerProcess, tiny_server: ServerProcess
) -> None:
    expected = [complete(tiny_server, prompt) for prompt in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: complete(dp_server, p), PROMPTS))
    assert got == expected
    assert all(count > 0 for count in replica_metric(dp_server, "dp_replica_dispatched_total"))
    assert replica_metric(dp_server, "dp_replica_requests") == [0.0, 0.0]  # all ended
    with dp_server.http() as http:
        engine = http.get("/v1/admin/engine").json()
        kv = http.get("/v1/admin/kv").json()
    assert len(engine["pids"]) == 2 and engine["pid"] == engine["pids"][0]
    assert kv["data_parallel_size"] == 2 and kv["blocks_in_use"] == 0
    with dp_server.http() as http:
        load = http.get("/get_load").json()
    assert [entry["dp_rank"] for entry in load] == [0, 1]
    assert all(entry["num_reqs"] == 0 and entry["num_tokens"] == 0 for entry in load)


def test_same_prefix_requests_stick_to_one_engine(dp_server: ServerProcess) -> None:
    before = replica_metric(dp_server, "dp_replica_dispatched_total")
    for user in range(6):
        complete(dp_server, f"{SYSTEM}User {user} asks a question.", max_tokens=2)
    after = replica_metric(dp_server, "dp_replica_dispatched_total")
    added = sorted(b - a for a, b in zip(before, after, strict=True))
    assert added == [0.0, 6.0]
    hits = replica_metric(dp_server, "dp_replica_prefix_cache_hits_total")
    assert max(hits) > 0


def test_streaming_through_two_engines(dp_server: ServerProcess) -> None:
    with (
        dp_server.http() as http,
        http.stream(
            "POST",
            "/v1/completions",
            json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "stream": True},
        ) as response,
    ):
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3


def test_one_engine_dying_fails_the_server(dp_server: ServerProcess) -> None:
    """Last in this module: it ends the module's server."""
    with dp_server.http() as http:
        pids = http.get("/v1/admin/engine").json()["pids"]
    os.kill(pids[1], signal.SIGKILL)
    wait_until(lambda: process_gone(pids[1]))
    with dp_server.http() as http:
        wait_until(lambda: http.get("/health").status_code == 503, timeout=20)
        response = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert response.status_code == 503
        assert "data-parallel engine 1" in response.json()["error"]["message"]
    assert dp_server.process.wait(30) == 1
    wait_until(lambda: process_gone(pids[0]), timeout=20)  # the other engine went with the server
