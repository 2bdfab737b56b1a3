"""tokenmill as a worker of SGLang's router: the real ``sglang_router.launch_router`` (0.3.2) with the
``cache_aware`` policy in front of two tiny-model servers (the second with ``--unknown-fields warn``)
answers every chat request; the router learns the model from ``/model_info`` and loads from
``/get_load``."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_process import TINY_ARGS, ServerProcess

ROUTER_START_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def workers(tiny_model_dir: str) -> Iterator[list[ServerProcess]]:
    """Two servers; the second ignores unknown fields (``--unknown-fields warn``). Started one after
    the other from this thread: a server gets SIGTERM when the thread that started it ends."""
    args = [*TINY_ARGS, "--served-model-name", "tiny", "--log-level", "warning"]
    first = ServerProcess(tiny_model_dir, args)
    try:
        second = ServerProcess(tiny_model_dir, [*args, "--unknown-fields", "warn"])
    except Exception:
        first.stop()
        raise
    yield [first, second]
    first.stop()
    second.stop()


@pytest.fixture(scope="module")
def router(workers: list[ServerProcess]) -> Iterator[str]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--policy",
        "cache_aware",
        "--log-level",
        "warn",
        "--worker-urls",
        *(w.base_url for w in workers),
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
        while True:
            assert process.poll() is None, f"the router exited with code {process.returncode}"
            try:
                workers_seen = httpx.get(f"{url}/workers", timeout=5).json()["workers"]
                if len(workers_seen) == 2 and all(w["is_healthy"] for w in workers_seen):
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            assert time.monotonic() < deadline, "the router did not register both workers"
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(30)


def test_router_learns_the_model_from_the_workers(router: str, workers: list[ServerProcess]) -> None:
    seen = httpx.get(f"{router}/workers", timeout=10).json()["workers"]
    assert sorted(w["url"] for w in seen) == sorted(w.base_url for w in workers)
    assert {w["model_id"] for w in seen} == {"tiny"}
    assert {w["metadata"]["model_type"] for w in seen} == {"llama"}


def test_router_answers_8_of_8_chat_requests(router: str) -> None:
    def ask(i: int) -> httpx.Response:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"question {i % 3}"}],
            "max_tokens": 4,
        }
        return httpx.post(f"{router}/v1/chat/completions", json=body, timeout=120)

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(ask, range(8)))
    assert [r.status_code for r in responses] == [200] * 8, [
        r.text for r in responses if r.status_code != 200
    ]
    for response in responses:
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        assert response.json()["usage"]["completion_tokens"] == 4


def test_get_load_reports_requests_and_tokens(workers: list[ServerProcess]) -> None:
    with workers[0].http() as http:
        response = http.get("/get_load")
    assert response.status_code == 200
    [load] = response.json()
    assert load == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}


def test_warn_policy_answers_and_lists_ignored_fields(workers: list[ServerProcess]) -> None:
    body = {"model": "tiny", "prompt": "<5> <6>", "max_tokens": 2, "frobnicate": 1, "zzz": {"a": 1}}
    with workers[1].http() as http:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["X-Ignored-Fields"] == "frobnicate,zzz"
    with workers[0].http() as http:
        rejected = http.post("/v1/completions", json=body)
    assert rejected.status_code == 400
    assert rejected.json()["error"]["message"] == "frobnicate: unrecognized request argument"
