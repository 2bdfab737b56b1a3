"""LoRA adapters in a live server: served by ``model`` name, listed, loaded, unloaded while in use,
reloaded; outputs equal transformers + PEFT (merged) and the KV cache is intact after."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from server_process import API_KEY, TINY_ARGS, ServerProcess, wait_until
from tiny_model import words

from tests.models.lora_adapters import Adapter, make_adapter

PROMPT = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]
NEW = 8
LONG = 1000


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Adapter]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    made = {
        name: make_adapter(
            hf, str(tmp_path_factory.mktemp(f"lora-{name}")), name, seed=seed, rank=8, scale=1.0
        )
        for name, seed in (("a", 1), ("b", 2), ("b2", 3))
    }
    made["base"] = Adapter(name="base", path="", merged=hf)
    return made


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, adapters: dict[str, Adapter]) -> Iterator[ServerProcess]:
    args = [*TINY_ARGS, "--served-model-name", "tiny", "--max-loras", "2", "--max-lora-rank", "16"]
    args += ["--enable-lora", "--lora-modules", f"a={adapters['a'].path}"]
    process = ServerProcess(tiny_model_dir, args, api_key=API_KEY)
    yield process
    process.stop()


def complete(
    server: ServerProcess, model: str, prompt: list[int] = PROMPT, max_tokens: int = NEW
) -> list[str]:
    with server.http() as http:
        response = http.post(
            "/v1/completions",
            json={
                "model": model,
                "prompt": words(prompt),
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert response.status_code == 200, response.text
        body = response.json()
    assert body["model"] == "tiny"
    return list(body["choices"][0]["text"].split())


def expected(adapter: Adapter, prompt: list[int] = PROMPT, max_tokens: int = NEW) -> list[str]:
    """The reference's greedy words; the special tokens (``<0>`` unknown, ``<1>`` EOS) are not in the text."""
    return [w for w in words(adapter.greedy(prompt, max_tokens)).split() if w not in ("<0>", "<1>")]


def test_adapters_are_served_listed_and_swapped(server: ServerProcess, adapters: dict[str, Adapter]) -> None:
    with server.http() as http:
        models = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    assert set(models) == {"tiny", "a"}
    assert models["a"]["parent"] == "tiny" and models["a"]["root"] == adapters["a"].path
    assert complete(server, "a") == expected(adapters["a"]) != expected(adapters["base"])
    assert complete(server, "tiny") == expected(adapters["base"])
    with server.http() as http:
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": adapters["b"].path})
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["rank"] == 8
        chat = http.post(
            "/v1/chat/completions",
            json={
                "model": "b",
                "messages": [{"role": "user", "content": words(PROMPT)}],
                "max_tokens": NEW,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert chat.status_code == 200, chat.text
    assert complete(server, "b") == expected(adapters["b"])
    assert server.metric("tokenmill:lora_loaded_adapters") == 2
    assert server.metric("tokenmill:lora_slot_swaps_total") >= 2


def test_bad_requests_are_clear(server: ServerProcess, adapters: dict[str, Adapter], tmp_path) -> None:  # type: ignore[no-untyped-def]
    with server.http() as http:
        missing = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "none")}
        )
        assert missing.status_code == 400 and "does not exist" in missing.json()["error"]["message"]
        unknown = http.post("/v1/completions", json={"model": "nope", "prompt": "<5>", "max_tokens": 2})
        assert unknown.status_code == 404
        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
        assert gone.status_code == 404
    import httpx

    anonymous = httpx.post(
        f"{server.base_url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/"}
    )
    assert anonymous.status_code == 401


def test_unload_while_running_then_reload(server: ServerProcess, adapters: dict[str, Adapter]) -> None:
    """A long request of adapter ``b`` runs while ``b`` is unloaded: it finishes with ``b``'s weights;
    new requests for ``b`` get 404; ``b`` reloaded from other weights serves those, never KV cached
    under the old ``b``; every block is back afterwards."""
    results: dict[str, list[str]] = {}
    runner = threading.Thread(
        target=lambda: results.setdefault("long", complete(server, "b", max_tokens=LONG))
    )
    runner.start()
    wait_until(lambda: server.kv()["num_running"] == 1, timeout=30)
    # Frozen in place while ``b`` is unloaded: the request is running whenever the unload lands.
    with server.paused_in_place(), server.http() as http:
        unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
        assert unloaded.status_code == 200, unloaded.text
        assert unloaded.json()["finishing_running"] == 1
        refused = http.post("/v1/completions", json={"model": "b", "prompt": "<5>", "max_tokens": 2})
        assert refused.status_code == 404
    runner.join(timeout=120)
    assert results["long"] == expected(adapters["b"], max_tokens=LONG)
    with server.http() as http:
        again = http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": adapters["b2"].path})
        assert again.status_code == 200, again.text
    assert complete(server, "b") == expected(adapters["b2"])
    assert complete(server, "a") == expected(adapters["a"])
    wait_until(lambda: server.kv()["blocks_in_use"] == 0)
    assert server.kv()["lora_loaded_adapters"] == 2
