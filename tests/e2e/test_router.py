"""``tokenmill router`` in front of two tiny-model ``tokenmill serve`` workers: chat, completions and
/generate are answered (as a worker answers them directly), streams pass through chunk by chunk,
same-prefix requests stay on one worker under ``cache_aware``, workers are removed and added at run
time (guarded by the router's API key), and a killed worker is skipped."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

import httpx
import pytest
from server_process import TINY_ARGS, ServerProcess, _die_with_parent, wait_until

ROUTER_KEY = "router-key-1"
SYSTEM = "You are a router test assistant. Answer briefly and kindly, please. " * 2


@pytest.fixture(scope="module")
def workers(tiny_model_dir: str) -> Iterator[list[ServerProcess]]:
    args = [*TINY_ARGS, "--served-model-name", "tiny"]
    first = ServerProcess(tiny_model_dir, args)
    try:
        second = ServerProcess(tiny_model_dir, args)
    except Exception:
        first.stop()
        raise
    yield [first, second]
    first.stop()
    second.stop()


@pytest.fixture(scope="module")
def router(workers: list[ServerProcess]) -> Iterator[str]:
    command = [
        sys.executable, "-m", "tokenmill.cli", "router", "--port", "0",
        "--worker-urls", *(w.base_url for w in workers),
        "--api-key", ROUTER_KEY, "--health-interval", "0.3", "--health-failure-threshold", "1",
        "--log-level", "warning",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, preexec_fn=_die_with_parent)
    found: list[str] = []
    announced = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("tokenmill router at ") and not found:
                found.append(line.rsplit(" ", 1)[1].strip())
                announced.set()

    threading.Thread(target=read, daemon=True).start()
    if not announced.wait(60):
        process.kill()
        raise RuntimeError("the router did not start")
    yield found[0]
    process.terminate()
    # uvicorn re-raises the SIGTERM it handled once it has shut down.
    assert process.wait(30) in (0, -signal.SIGTERM)


def http(router: str, key: str | None = ROUTER_KEY) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=router, headers=headers, timeout=60)


def workers_state(router: str) -> dict[str, dict[str, object]]:
    with http(router) as client:
        return {w["url"]: w for w in client.get("/workers").json()["workers"]}


COMPLETION = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 6, "temperature": 0}
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hi there"}],
    "max_tokens": 6,
    "temperature": 0,
}
GENERATE = {"text": "hello world", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


def test_routes_answer_as_a_worker_does(router: str, workers: list[ServerProcess]) -> None:
    with http(router) as client, workers[0].http() as direct:
        for path, body in (
            ("/v1/completions", COMPLETION),
            ("/v1/chat/completions", CHAT),
            ("/generate", GENERATE),
        ):
            routed = client.post(path, json=body)
            assert routed.status_code == 200, routed.text
            expected = direct.post(path, json=body).json()
            if path == "/generate":
                assert routed.json()["output_ids"] == expected["output_ids"]
            else:
                assert routed.json()["choices"] == expected["choices"]
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
        assert client.get("/v1/models/tiny").status_code == 200
        # A worker's own errors pass through with their status and body.
        bad = client.post("/v1/completions", json={**COMPLETION, "max_tokens": -1})
        assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
        metrics = client.get("/metrics").text
    assert "tokenmill_router:worker_dispatched_total" in metrics


def test_the_api_key_guards_everything_but_health(router: str) -> None:
    with http(router, key=None) as client:
        assert client.get("/health").status_code == 200
        assert client.post("/v1/completions", json=COMPLETION).status_code == 401
        assert client.post("/workers", json={"url": "http://127.0.0.1:9"}).status_code == 401
        assert client.delete("/workers/http://127.0.0.1:9").status_code == 401


def test_streaming_passes_through(router: str) -> None:
    body = {**COMPLETION, "max_tokens": 8}
    with http(router) as client:
        whole = client.post("/v1/completions", json=body).json()["choices"][0]
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = [
                line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")
            ]
    # The worker sends as many chunks as its timing makes (one per change it sees); together they
    # must be the whole answer, and the router must pass every one of them on.
    assert events[-1] == "[DONE]" and len(events) >= 2
    choices = [c for e in events[:-1] for c in json.loads(e)["choices"]]
    assert "".join(c["text"] for c in choices) == whole["text"]
    assert [c["finish_reason"] for c in choices][-1] == whole["finish_reason"]


def test_same_prefix_requests_stick_to_one_worker(router: str) -> None:
    before = {url: w["dispatched"] for url, w in workers_state(router).items()}
    with http(router) as client:
        for user in range(5):
            body = {"model": "tiny", "prompt": f"{SYSTEM}User {user}:", "max_tokens": 2, "temperature": 0}
            assert client.post("/v1/completions", json=body).status_code == 200
    after = {url: w["dispatched"] for url, w in workers_state(router).items()}
    assert sorted(after[url] - before[url] for url in after) == [0, 5]  # type: ignore[operator]


def test_workers_are_removed_and_added_at_run_time(router: str, workers: list[ServerProcess]) -> None:
    gone = workers[1].base_url
    with http(router) as client:
        assert client.delete(f"/workers/{gone}").json() == {"removed": gone}
        assert client.delete(f"/workers/{quote(gone, safe='')}").status_code == 404
        assert list(workers_state(router)) == [workers[0].base_url]
        with ThreadPoolExecutor(4) as pool:
            codes = list(
                pool.map(lambda i: client.post("/v1/completions", json=COMPLETION).status_code, range(4))
            )
        assert codes == [200] * 4
        assert client.post("/workers", json={"url": "ftp://x"}).status_code == 400
        added = client.post("/workers", json={"url": gone})
        assert added.json() == {"url": gone, "healthy": True}
        before = workers_state(router)[gone]["dispatched"]
        for _ in range(4):  # round the two workers: the new one (empty, idle) gets work
            body = {**COMPLETION, "prompt": f"fresh prompt {_} " * 8}
            assert client.post("/v1/completions", json=body).status_code == 200
        assert workers_state(router)[gone]["dispatched"] > before  # type: ignore[operator]


def test_a_killed_worker_is_skipped(router: str, workers: list[ServerProcess]) -> None:
    """Last in this module: it stops a worker."""
    dead = workers[1]
    dead.stop()
    with http(router) as client:
        codes = [
            client.post("/v1/completions", json={**COMPLETION, "prompt": f"after death {i} " * 6}).status_code
            for i in range(6)
        ]
        assert codes == [200] * 6
        wait_until(lambda: workers_state(router)[dead.base_url]["healthy"] is False, timeout=10)
        assert client.get("/health").status_code == 200
