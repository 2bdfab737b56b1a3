"""Servers of their own: a full waiting queue (429), a killed engine (503 in flight and after, then
the server exits with status 1),
shutdown by signal with a request in flight (no orphan engine process), and an unknown model (its
message, no engine left); and the engine process's CPU priority."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from server_process import TINY_ARGS, ServerProcess, process_gone, wait_for_engine, wait_until
from tiny_model import words

LONG = {"prompt": words([5, 6, 7]), "max_tokens": 4000, "ignore_eos": True}
SHORT = {"prompt": words([5, 6, 7]), "max_tokens": 2}


def test_full_waiting_queue_is_429(tiny_model_dir: str) -> None:
    server = ServerProcess(tiny_model_dir, [*TINY_ARGS, "--max-num-seqs", "1", "--max-waiting", "1"])

    async def run() -> None:
        async with server.async_http() as http:
            async with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as running:
                assert running.status_code == 200
                # Frozen in place while the queue fills: the long request holds the one seat throughout (it
                # would otherwise end in ~3 s, which a loaded machine's client calls can outlast).
                await wait_for_engine(http, "num_running", 1)
                with server.paused_in_place():
                    # One sequence runs at a time, so this one waits; the queue is then full.
                    waiting = asyncio.ensure_future(http.post("/v1/completions", json=SHORT))
                    await wait_for_engine(http, "num_waiting", 1)
                    refused = await http.post("/v1/completions", json=SHORT)
                    assert refused.status_code == 429
                    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
                    with pytest.raises(openai.RateLimitError):
                        await server.async_client().completions.create(model=tiny_model_dir, **SHORT)  # type: ignore[arg-type]
            # Closing the running stream aborts it; the waiting request then runs to the end.
            answered = await waiting
            assert answered.status_code == 200
            assert answered.json()["choices"][0]["finish_reason"] in ("stop", "length")

    try:
        asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        server.stop()


EXIT_DELAY_S = 5.0


def test_killed_engine_fails_fast_then_the_server_exits(tiny_model_dir: str) -> None:
    server = ServerProcess(tiny_model_dir, [*TINY_ARGS, "--engine-death-exit-delay", str(EXIT_DELAY_S)])
    engine_pid = server.engine_pid()

    async def run() -> None:
        async with server.async_http() as http:
            async with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as streaming:
                pending = asyncio.ensure_future(http.post("/v1/completions", json=LONG))
                await wait_for_engine(http, "num_running", 2)
                os.kill(engine_pid, signal.SIGKILL)
                events = [line async for line in streaming.aiter_lines() if line]
            killed_at = time.monotonic()
            # In flight: the stream ends with an error event and [DONE]; the plain request gets a 503.
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2].removeprefix("data: "))["error"]
            assert error["code"] == "engine_unavailable" and error["type"] == "server_error"
            answered = await pending
            assert answered.status_code == 503
            assert answered.json()["error"]["code"] == "engine_unavailable"
            # Afterwards: health fails and new work is refused at once with 503.
            assert (await http.get("/health")).status_code == 503
            health_generate = await http.get("/health_generate")
            assert health_generate.status_code == 503
            assert health_generate.json()["error"]["code"] == "engine_unavailable"
            for path, body in [
                ("/v1/completions", SHORT),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "<5>"}]}),
                ("/generate", {"text": "<5>"}),
            ]:
                refused = await http.post(path, json=body)
                assert refused.status_code == 503
                assert refused.json()["error"]["code"] == "engine_unavailable"
            metrics = (await http.get("/metrics")).text
            assert any(
                line.startswith("tokenmill:engine_alive") and line.endswith(" 0.0")
                for line in metrics.splitlines()
            )
            assert time.monotonic() - killed_at < EXIT_DELAY_S, "the checks above ran past the delay"
        # Then the server exits by itself, with status 1, for its supervisor to restart it.
        assert server.process.wait(EXIT_DELAY_S + 20) == 1

    try:
        asyncio.run(asyncio.wait_for(run(), 60))
        assert process_gone(engine_pid)
    finally:
        server.stop()


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["SIGINT", "SIGTERM", "SIGKILL"]
)
def test_signal_shuts_down_with_a_stream_in_flight(tiny_model_dir: str, sig: int) -> None:
    server = ServerProcess(tiny_model_dir, [*TINY_ARGS, "--shutdown-timeout", "1"])
    engine_pid = server.engine_pid()
    try:
        with (
            server.http() as http,
            http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r,
        ):
            assert r.status_code == 200
            server.process.send_signal(sig)
            # The stream ends (the server cuts it) rather than running to 4000 tokens.
            with contextlib.suppress(httpx.HTTPError):
                for _ in r.iter_lines():
                    pass
        server.process.wait(30)
    finally:
        server.stop()
    if sig == signal.SIGKILL:
        # No clean-up ran in the server: the engine notices its parent is gone and exits by itself.
        wait_until(lambda: process_gone(engine_pid), timeout=20)
    else:
        # The server stops its engine and waits for it before exiting.
        assert process_gone(engine_pid), "the engine process outlived the server"


def engine_processes_of(parent_pid: int) -> list[int]:
    """Pids of engine processes started by ``parent_pid`` (read from /proc: their ``--parent-pid``)."""
    marker = f"--parent-pid\x00{parent_pid}\x00".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if marker in cmdline.read():
                    pids.append(int(entry))
    return pids


def test_an_unknown_model_ends_serve_with_its_message_and_no_engine_left() -> None:
    """The engine process starts before the server resolves the model (their start-ups overlap); a
    model that does not resolve still ends the command with its message, and the early engine with it."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.server", "no-such-model", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 1
    assert "tokenmill serve: unknown model 'no-such-model'" in stderr
    assert engine_processes_of(process.pid) == []


def thread_niceness(pid: int) -> set[int]:
    """The nice values of every thread of ``pid`` (field 19 of /proc/<pid>/task/<tid>/stat)."""
    values = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/stat") as stat:
            values.add(int(stat.read().rsplit(")", 1)[1].split()[16]))
    return values


def test_the_engine_process_yields_the_cpu_to_the_server(tiny_server: ServerProcess) -> None:
    # On a CPU, serve lowers the engine process's priority by --engine-niceness (default 5), every
    # thread of it (they inherit it from the thread that starts them); the server keeps its own.
    with tiny_server.http() as http:
        assert http.post("/v1/completions", json=SHORT).status_code == 200  # the kernels' threads exist
    server_niceness = thread_niceness(tiny_server.process.pid)
    assert len(server_niceness) == 1
    (base,) = server_niceness
    assert thread_niceness(tiny_server.engine_pid()) == {min(19, base + 5)}
