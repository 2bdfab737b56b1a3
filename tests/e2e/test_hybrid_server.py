"""A hybrid (linear + full attention) model through the server: the next turn resumes from a snapshot.

A tiny random Qwen3-Next (``tests/models/test_qwen3_next.py``'s config) is served; the second turn of
a conversation (the first prompt, its completion, new words) must report cached prompt tokens (a
state snapshot restored with the attention layers' blocks) and both completions must equal
transformers' greedy continuations. ``/v1/admin/kv`` reports the snapshots and their bytes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_process import ServerProcess

from tests.conftest import TinyModel, save_tiny_model
from tests.models.test_qwen3_next import SPEC


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, TinyModel]]:
    folder = str(tmp_path_factory.mktemp("tiny-hybrid-server"))
    hf = save_tiny_model(SPEC, seed=43, folder=folder)
    hf.generation_config.eos_token_id = None
    args = ["--dtype", "float32", "--block-size", "4", "--num-blocks", "256", "--served-model-name", "hybrid"]
    server = ServerProcess(folder, args)
    try:
        yield server, TinyModel(arch="qwen3_next", path=folder, hf=hf)
    finally:
        server.stop()


def complete(server: ServerProcess, prompt: list[int]) -> tuple[list[int], int]:
    with server.http() as http:
        response = http.post(
            "/v1/completions",
            json={
                "model": "hybrid",
                "prompt": " ".join(f"w{t}" for t in prompt),
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        response.raise_for_status()
        body = response.json()
    tokens = [int(word[1:]) for word in body["choices"][0]["text"].split()]
    return tokens, int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_the_next_turn_resumes_from_a_state_snapshot(hybrid: tuple[ServerProcess, TinyModel]) -> None:
    server, model = hybrid
    first = [5 + (3 * i) % 150 for i in range(21)]
    reply, cached = complete(server, first)
    assert reply == model.greedy(first, 8) and cached == 0
    second = first + reply + [40, 41, 42, 43]
    answer, cached = complete(server, second)
    assert answer == model.greedy(second, 8)
    assert cached == 28  # 21 prompt + 7 computed output tokens: the snapshot at block boundary 28
    kv = server.kv()
    assert int(kv["state_snapshots"]) > 0  # type: ignore[call-overload]
    assert kv["state_snapshot_bytes"] == int(kv["state_snapshots"]) * int(kv["state_slot_bytes"])  # type: ignore[call-overload]
