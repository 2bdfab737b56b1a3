"""Run a real ``tokenmill serve`` process for end-to-end tests, and small helpers around it.

The server is ``python -m tokenmill.server MODEL --port 0``; ``ServerProcess`` reads the URL from the
line the server prints once it listens, so there is no free-port race.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import openai

API_KEY = "test-key-123"
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the test process dies, so no server outlives a crash."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class ServerProcess:
    """A running server: its process, URL and helpers to talk to it."""

    def __init__(
        self, model: str, args: list[str], api_key: str | None = None, log_path: str | None = None
    ) -> None:
        """Start the server; with ``log_path`` its stderr (the log) goes to that file."""
        self.api_key = api_key
        self.log_path = log_path
        command = [sys.executable, "-m", "tokenmill.server", model, "--host", "127.0.0.1", "--port", "0"]
        command += args
        if api_key is not None:
            command += ["--api-key", api_key]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        stderr = open(log_path, "w") if log_path is not None else None  # noqa: SIM115 - the child writes it
        try:
            self.process = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=env,
                preexec_fn=_die_with_parent,
            )
        finally:
            if stderr is not None:
                stderr.close()
        self.base_url = self._wait_for_url()
        self.url = self.base_url + "/v1"

    def _wait_for_url(self) -> str:
        """Read stdout until the server announces its URL; fail with its exit code if it dies first."""
        found: list[str] = []
        announced = threading.Event()
        assert self.process.stdout is not None
        stdout = self.process.stdout

        def read() -> None:
            for line in stdout:  # keep draining so the server can never block on a full pipe
                if line.startswith("tokenmill serving") and not found:
                    found.append(line.rsplit(" at ", 1)[1].strip())
                    announced.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not announced.wait(0.1):
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the server exited with code {self.process.returncode} before it was ready"
                )
            if time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f"the server was not ready after {START_TIMEOUT_S} s")
        return found[0].removesuffix("/v1")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def http(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=60.0, **kwargs)  # type: ignore[arg-type]

    def async_http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=60.0)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=self.api_key or "unused", max_retries=0, timeout=60.0)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.url, api_key=self.api_key or "unused", max_retries=0, timeout=60.0
        )

    def log(self) -> str:
        assert self.log_path is not None, "this server logs to the terminal"
        with open(self.log_path) as log:
            return log.read()

    def metric(self, name: str) -> float:
        """The value of an unlabelled-but-for-model Prometheus sample, e.g. ``tokenmill:num_requests_running``."""
        with self.http() as http:
            text = http.get("/metrics").text
        for line in text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    @contextlib.contextmanager
    def paused_in_place(self) -> Iterator[None]:
        """The engine frozen for the block (``/pause_generation`` in place: running requests keep their KV
        and no step is taken; new ones are admitted and wait; aborts still land), then let go on, also when
        the block fails. For tests that need a request still in flight at a later moment: the tiny model
        makes ~1,500 tokens a second, faster than a loaded machine's few calls."""
        with self.http() as http:
            assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
            try:
                yield
            finally:
                assert http.post("/continue_generation").status_code == 200

    def engine_pid(self) -> int:
        with self.http() as http:
            return int(http.get("/v1/admin/engine").json()["pid"])

    def kv(self) -> dict[str, object]:
        with self.http() as http:
            response = http.get("/v1/admin/kv")
            response.raise_for_status()
            return dict(response.json())

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Send ``sig`` and wait for the server to exit; returns its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise
        return self.process.returncode


def process_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def wait_for_engine(http: httpx.AsyncClient, key: str, value: int) -> None:
    """Poll ``/v1/admin/kv`` until the engine reports ``key == value`` (bounded by the caller's timeout)."""
    while (await http.get("/v1/admin/kv")).json()[key] != value:
        await asyncio.sleep(0.01)


def wait_until(condition: Callable[[], bool], timeout: float = 20.0, interval: float = 0.02) -> None:
    """Poll ``condition()`` until it is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


# Small and quick: 8192 KV tokens in blocks of 4, one torch thread (the test machine has two cores).
TINY_ARGS = [
    "--dtype", "float32",
    "--num-threads", "1",
    "--block-size", "4",
    "--num-blocks", "2048",
    "--max-num-batched-tokens", "256",
    "--log-level", "warning",
]  # fmt: skip
