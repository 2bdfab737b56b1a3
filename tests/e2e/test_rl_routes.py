"""The RL routes through a live server: weight updates, weight version, pause, memory release.

A server of its own (the updates change its weights): the tiny Llama A, updated to B (same
architecture, other weights) and back. Outputs after an update equal transformers' on the new
weights; bad bodies are 400s that leave A serving; a prompt cached under A is not reused under B.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import threading
from collections.abc import Iterator

import httpx
import pytest
import torch
from safetensors.torch import save as save_safetensors
from server_process import API_KEY, TINY_ARGS, ServerProcess
from tiny_model import build_tiny_model
from transformers import LlamaForCausalLM

from tests.conftest import spread_weights

PROMPT = [5, 9, 14, 20, 27, 35, 44, 54, 65]
# Tokens of a request that must still be running when a pause lands: the tiny model makes ~1,500 a second,
# and two of them fit the server's 8192 cache slots.
LONG = 3000


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    a = str(tmp_path_factory.mktemp("rl-a"))
    build_tiny_model(a)
    b = str(tmp_path_factory.mktemp("rl-b"))
    model = LlamaForCausalLM.from_pretrained(a)
    spread_weights(model, seed=7, norm=0.1, lm_head=0.5, layers=2.0)
    model.save_pretrained(b)
    for name in os.listdir(a):
        if name.startswith("tokenizer") or name.startswith("special_tokens"):
            shutil.copy(os.path.join(a, name), os.path.join(b, name))
    return a, b


@pytest.fixture(scope="module")
def references(folders: tuple[str, str]) -> dict[str, LlamaForCausalLM]:
    return {name: LlamaForCausalLM.from_pretrained(path).eval() for name, path in zip("ab", folders)}


@pytest.fixture(scope="module")
def server(folders: tuple[str, str]) -> Iterator[ServerProcess]:
    process = ServerProcess(folders[0], [*TINY_ARGS, "--served-model-name", "tiny"], api_key=API_KEY)
    yield process
    process.stop()


def expected(model: LlamaForCausalLM, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=None
    )
    return out[0, len(prompt) :].tolist()  # type: ignore[no-any-return]


def complete(server: ServerProcess, prompt: list[int] = PROMPT, n: int = 6) -> tuple[list[int], int]:
    """Greedy completion of ``prompt``: its token ids (read back from the tiny tokenizer's words)
    and how many prompt tokens came from the prefix cache."""
    with server.http() as http:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    result = response.json()
    tokens = [int(t) for t in re.findall(r"<(\d+)>", result["choices"][0]["text"])]
    assert len(tokens) == n, result
    return tokens, result["usage"]["prompt_tokens_details"]["cached_tokens"]


def post(server: ServerProcess, path: str, **kwargs: object) -> httpx.Response:
    with server.http() as http:
        return http.post(path, **kwargs)  # type: ignore[arg-type]


def blob(tensors: dict[str, torch.Tensor]) -> bytes:
    return save_safetensors({n: t.detach().contiguous() for n, t in tensors.items()})


def test_routes_need_the_api_key(server: ServerProcess) -> None:
    response = httpx.post(server.base_url + "/pause_generation", json={"mode": "abort"}, timeout=10)
    assert response.status_code == 401
    with server.http() as http:
        assert http.get("/get_weight_version").json() == {"weight_version": "default"}


def test_bad_bodies_are_400_and_keep_the_old_weights(
    server: ServerProcess, folders: tuple[str, str], references: dict[str, LlamaForCausalLM]
) -> None:
    state_b = references["b"].state_dict()
    good = {"model.norm.weight": state_b["model.norm.weight"]}
    bad_shape = {**good, "model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}
    unknown = {**good, "model.layers.7.mlp.up_proj.weight": torch.zeros(128, 64)}
    cases = [
        ("/update_weights_from_disk", {"json": {"model_path": folders[0] + "/missing"}}, "no such model folder"),
        ("/update_weights_from_disk", {"json": {}}, "model_path"),
        ("/update_weights_from_tensor", {"content": blob(bad_shape), "headers": {"content-type": "application/octet-stream"}}, "has shape [3, 3]"),
        ("/update_weights_from_tensor", {"json": {"serialized_named_tensors": base64.b64encode(blob(unknown)).decode()}}, "unknown weight name"),
        ("/update_weights_from_tensor", {"json": {"serialized_named_tensors": "%%%"}}, "not base64"),
        ("/update_weights_from_tensor", {"json": {"serialized_named_tensors": "AAAA", "load_format": "flattened_bucket"}}, "never pickle"),
        ("/update_weights_from_tensor", {"content": b"junk", "headers": {"content-type": "application/octet-stream"}}, "not a safetensors blob"),
        ("/update_weights_from_distributed", {"json": {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]}}, "init_weights_update_group first"),
        ("/update_weights_from_distributed", {"json": {"names": ["model.norm.weight"], "dtypes": ["float32"]}}, "shapes"),
        ("/pause_generation", {"json": {"mode": "sideways"}}, "mode"),
        ("/release_memory_occupation", {"json": {"tags": ["gpu"]}}, "tags"),
    ]  # fmt: skip
    for path, request, message in cases:
        response = post(server, path, **request)
        assert response.status_code == 400, (path, response.text)
        assert message in response.json()["error"]["message"], (path, response.text)
    with server.http() as http:
        assert http.get("/get_weight_version").json() == {"weight_version": "default"}
    assert complete(server)[0] == expected(references["a"], PROMPT, 6)


def test_updates_change_outputs_and_never_reuse_a_stale_prefix(
    server: ServerProcess, folders: tuple[str, str], references: dict[str, LlamaForCausalLM]
) -> None:
    complete(server)
    assert complete(server)[1] == 8  # cached under A
    state_b = references["b"].state_dict()
    response = post(
        server,
        "/update_weights_from_tensor?weight_version=b-raw",
        content=blob(state_b),
        headers={"content-type": "application/octet-stream"},
    )
    assert response.status_code == 200 and response.json()["weight_version"] == "b-raw"
    assert complete(server) == (expected(references["b"], PROMPT, 6), 0)
    # JSON with base64, SGLang's field names.
    encoded = base64.b64encode(blob(state_b)).decode()
    response = post(
        server,
        "/update_weights_from_tensor",
        json={"serialized_named_tensors": [encoded], "weight_version": "b-json"},
    )
    assert response.status_code == 200, response.text
    assert complete(server) == (expected(references["b"], PROMPT, 6), 0)
    response = post(
        server, "/update_weights_from_disk", json={"model_path": folders[0], "weight_version": "a-again"}
    )
    assert response.status_code == 200 and response.json()["success"] is True
    assert complete(server) == (expected(references["a"], PROMPT, 6), 0)
    with server.http() as http:
        assert http.get("/get_weight_version").json() == {"weight_version": "a-again"}
        assert http.get("/v1/admin/kv").json()["all_free_or_cached"] is True


def _stream_tokens(
    server: ServerProcess, prompt: list[int], n: int, results: list[dict[str, object]]
) -> None:
    with server.http() as http:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        response = http.post("/v1/completions", json=body)
    results.append(response.json())


def _wait_running(server: ServerProcess, count: int) -> None:
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if server.kv()["num_running"] == count:
            return
        time.sleep(0.02)
    raise AssertionError(f"{count} requests never ran together")


@pytest.mark.parametrize("mode", ["abort", "in_place", "retract"])
def test_pause_with_requests_in_flight(server: ServerProcess, mode: str) -> None:
    """Nothing is lost or hangs: under abort every request comes back cut short; under in_place
    and retract every request completes after continue_generation. Blocks all come back."""
    results: list[dict[str, object]] = []
    threads = [
        threading.Thread(target=_stream_tokens, args=(server, [6 + i, 7, 8, 9, 10], LONG, results))
        for i in range(2)
    ]
    for thread in threads:
        thread.start()
    _wait_running(server, 2)
    response = post(server, "/pause_generation", json={"mode": mode})
    assert response.status_code == 200, response.text
    assert server.kv()["paused"] is True
    if mode == "abort":
        for thread in threads:
            thread.join(30)
        assert [r["choices"][0]["finish_reason"] for r in results] == ["abort", "abort"]  # type: ignore[index]
        assert all(0 < r["usage"]["completion_tokens"] < LONG for r in results)  # type: ignore[index]
    else:
        kv = server.kv()
        assert kv["num_running"] == (2 if mode == "in_place" else 0)
        assert kv["blocks_in_use"] > 0 if mode == "in_place" else kv["blocks_in_use"] == 0
    assert post(server, "/continue_generation").status_code == 200
    for thread in threads:
        thread.join(60)
    assert len(results) == 2
    if mode != "abort":
        assert all(r["usage"]["completion_tokens"] == LONG for r in results)  # type: ignore[index]
    kv = server.kv()
    assert kv["all_free_or_cached"] is True and kv["paused"] is False


def test_release_memory_gets_503_until_resumed(
    server: ServerProcess, references: dict[str, LlamaForCausalLM]
) -> None:
    assert post(server, "/pause_generation", json={"mode": "retract"}).status_code == 200
    response = post(server, "/release_memory_occupation", json={})
    assert response.status_code == 200, response.text
    with server.http() as http:
        refused = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
    assert refused.status_code == 503 and "resume_memory_occupation" in refused.json()["error"]["message"]
    assert (
        post(server, "/resume_memory_occupation", json={"tags": ["kv_cache", "weights"]}).status_code == 200
    )
    assert post(server, "/continue_generation").status_code == 200
    tokens, cached = complete(server)
    assert cached == 0
    assert tokens == expected(references["a"], PROMPT, 6)


def _generate(server: ServerProcess, payload: dict[str, object], results: list[dict[str, object]]) -> None:
    with server.http() as http:
        response = http.post("/generate", json=payload)
    assert response.status_code == 200, response.text
    results.append(response.json())


def test_generate_reports_each_tokens_weight_version(
    server: ServerProcess, references: dict[str, LlamaForCausalLM]
) -> None:
    """A rollout paused in place across an update: /generate's meta_info says which tokens came
    from which weights (a trainer masks the older ones), and the final weight version."""
    with server.http() as http:
        before = http.get("/get_weight_version").json()["weight_version"]
    results: list[dict[str, object]] = []
    payload = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": LONG, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    thread = threading.Thread(target=_generate, args=(server, payload, results))
    thread.start()
    _wait_running(server, 1)
    assert post(server, "/pause_generation", json={"mode": "in_place"}).status_code == 200
    state_b = references["b"].state_dict()
    encoded = base64.b64encode(blob(state_b)).decode()
    response = post(
        server,
        "/update_weights_from_tensor",
        json={"serialized_named_tensors": encoded, "weight_version": "rl-b"},
    )
    assert response.status_code == 200, response.text
    assert post(server, "/continue_generation").status_code == 200
    thread.join(60)
    meta = results[0]["meta_info"]  # type: ignore[index]
    versions = meta["output_token_weight_versions"]  # type: ignore[index]
    assert len(versions) == LONG == len(meta["output_token_logprobs"])  # type: ignore[index]
    switch = versions.index("rl-b")
    assert switch > 0 and versions == [before] * switch + ["rl-b"] * (LONG - switch)
    assert results[0]["output_ids"][:switch] == expected(references["a"], PROMPT, switch)  # type: ignore[index]
    with server.http() as http:
        assert http.get("/model_info").status_code == 200
        assert http.get("/get_weight_version").json()["weight_version"] == "rl-b"
    assert (
        post(server, "/update_weights_from_disk", json={"model_path": "", "weight_version": "x"}).status_code
        == 400
    )
