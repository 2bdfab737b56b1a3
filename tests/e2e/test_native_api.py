"""SGLang's native API on the live tiny server: /generate (single, batch, n, stream, logprobs,
prompt-only), /abort_request, /flush_cache, /model_info, /server_info, /health_generate, /encode,
and the exact request shapes the ``sglang`` frontend's ``RuntimeEndpoint`` sends."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from server_process import ServerProcess, wait_until
from tiny_model import words

GREEDY = {"temperature": 0, "ignore_eos": True}


def generate(server: ServerProcess, payload: dict[str, Any], status: int = 200) -> Any:
    with server.http() as http:
        response = http.post("/generate", json=payload)
    assert response.status_code == status, response.text
    return response.json()


def stream_events(server: ServerProcess, payload: dict[str, Any]) -> list[Any]:
    """The decoded ``data:`` payloads of a streamed /generate, ending with the string ``[DONE]``."""
    with (
        server.http() as http,
        http.stream("POST", "/generate", json={**payload, "stream": True}) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        body = response.read().decode()
    events = [block.removeprefix("data: ") for block in body.split("\n\n") if block]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def completion_logprobs(server: ServerProcess, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    with server.client() as client:
        response = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            logprobs=2,
            extra_body={"ignore_eos": True},
            **extra,
        )
    choice = response.choices[0]
    assert choice.logprobs is not None
    return {"text": choice.text, "logprobs": choice.logprobs}


def token_id(text: str) -> int:
    return int(text.strip().removeprefix("<").removesuffix(">"))


# ---------------------------------------------------------------------------------------------------
# /generate


def test_greedy_generate_equals_completions_with_their_logprobs(tiny_server: ServerProcess) -> None:
    prompt = words([5, 6, 7, 8])
    out = generate(
        tiny_server,
        {
            "text": prompt,
            "sampling_params": {"max_new_tokens": 6, **GREEDY},
            "return_logprob": True,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
            "rid": "native-greedy-1",
        },
    )
    reference = completion_logprobs(tiny_server, prompt, 6)
    assert out["text"] == reference["text"]
    expected_ids = [token_id(t) for t in reference["logprobs"].tokens]
    assert out["output_ids"] == expected_ids
    meta = out["meta_info"]
    assert meta["id"] == "native-greedy-1"
    assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == 6
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["weight_version"] == "default"
    assert meta["e2e_latency"] > 0 and isinstance(meta["cached_tokens"], int)
    # Output logprobs: [logprob, token_id, text], equal to the OpenAI route's.
    entries = meta["output_token_logprobs"]
    assert [e[1] for e in entries] == expected_ids
    assert [e[2] for e in entries] == reference["logprobs"].tokens
    for entry, value in zip(entries, reference["logprobs"].token_logprobs):
        assert entry[0] == pytest.approx(value, abs=1e-5)
    tops = meta["output_top_logprobs"]
    assert len(tops) == 6
    for top, ref_top in zip(tops, reference["logprobs"].top_logprobs):
        assert len(top) == 2 and top[0][0] >= top[1][0]
        assert {e[2]: pytest.approx(e[0], abs=1e-5) for e in top} == ref_top
    # The default logprob_start_len (-1) keeps SGLang's shape: one null entry for the last prompt token.
    assert meta["input_token_logprobs"] == [[None, 8, "<8>"]]
    assert meta["input_top_logprobs"] == [None]


def test_input_ids_and_text_batches_answer_each_prompt_in_order(tiny_server: ServerProcess) -> None:
    prompts = [[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34]]
    params = {"max_new_tokens": 4, **GREEDY}
    singles = [generate(tiny_server, {"input_ids": p, "sampling_params": params}) for p in prompts]
    assert all(isinstance(s, dict) for s in singles)
    by_ids = generate(tiny_server, {"input_ids": prompts, "sampling_params": params, "rid": "nb"})
    by_text = generate(tiny_server, {"text": [words(p) for p in prompts], "sampling_params": [params] * 3})
    assert isinstance(by_ids, list) and len(by_ids) == 3 and len(by_text) == 3
    for single, a, b, prompt in zip(singles, by_ids, by_text, prompts):
        assert a["output_ids"] == b["output_ids"] == single["output_ids"]
        assert a["text"] == b["text"] == single["text"]
        assert a["meta_info"]["prompt_tokens"] == len(prompt)
    assert [a["meta_info"]["id"] for a in by_ids] == ["nb_0", "nb_1", "nb_2"]
    assert len(set(single["text"] for single in singles)) == 3


def test_n_samples_come_sample_major_with_their_own_ids(tiny_server: ServerProcess) -> None:
    one = generate(
        tiny_server,
        {
            "text": words([40, 41, 42]),
            "sampling_params": {
                "max_new_tokens": 5,
                "n": 3,
                "temperature": 1.0,
                "seed": 3,
                "ignore_eos": True,
            },
            "rid": "ns",
        },
    )
    assert isinstance(one, list) and [o["meta_info"]["id"] for o in one] == ["ns_0", "ns_1", "ns_2"]
    assert all(len(o["output_ids"]) == 5 for o in one)
    assert len({tuple(o["output_ids"]) for o in one}) > 1  # samples differ at temperature 1
    prompts = [[50, 51, 52], [60, 61]]
    batch = generate(
        tiny_server,
        {"input_ids": prompts, "sampling_params": {"max_new_tokens": 3, "n": 2, **GREEDY}, "rid": ["a", "b"]},
    )
    assert [o["meta_info"]["id"] for o in batch] == ["a_0", "b_0", "a_1", "b_1"]
    assert [o["meta_info"]["prompt_tokens"] for o in batch] == [3, 2, 3, 2]
    assert batch[0]["output_ids"] == batch[2]["output_ids"]  # greedy: both samples agree


def test_stream_sends_cumulative_chunks_then_done(tiny_server: ServerProcess) -> None:
    payload = {"text": words([70, 71, 72]), "sampling_params": {"max_new_tokens": 8, **GREEDY}}
    whole = generate(tiny_server, payload)
    events = stream_events(tiny_server, {**payload, "return_logprob": True})
    assert events[-1] == "[DONE]"
    # How many events there are depends on timing (the handler sends the state as it stands when it
    # runs; the tiny model may finish first): test_native_generate_stream.py checks one per change.
    chunks = events[:-1]
    assert chunks
    for before, after in zip(chunks, chunks[1:]):
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
        assert before["meta_info"]["finish_reason"] is None
    last = chunks[-1]
    assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert len(last["meta_info"]["output_token_logprobs"]) == 8
    assert all("index" not in c for c in chunks)
    batch_events = stream_events(
        tiny_server, {"input_ids": [[73, 74], [75, 76]], "sampling_params": {"max_new_tokens": 3, **GREEDY}}
    )
    assert batch_events[-1] == "[DONE]"
    finals = {c["index"]: c for c in batch_events[:-1] if c["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1]
    assert all(len(c["output_ids"]) == 3 for c in finals.values())


def test_input_token_logprobs_from_logprob_start_len(tiny_server: ServerProcess) -> None:
    ids = [80, 81, 82, 83, 84, 85]
    with tiny_server.client() as client:
        echoed = client.completions.create(
            model="tiny", prompt=words(ids), max_tokens=1, temperature=0, logprobs=1, echo=True
        )
    assert echoed.choices[0].logprobs is not None
    prompt_values = echoed.choices[0].logprobs.token_logprobs[: len(ids)]
    assert prompt_values[0] is None
    full = generate(
        tiny_server,
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 1, **GREEDY},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    entries = full["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == ids
    assert entries[0] == [None, 80, None]
    for entry, value in zip(entries[1:], prompt_values[1:]):
        assert entry[0] == pytest.approx(value, abs=1e-5)
    part = generate(
        tiny_server,
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 1, **GREEDY},
            "return_logprob": True,
            "logprob_start_len": 3,
            "top_logprobs_num": 1,
        },
    )
    meta = part["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == ids[3:]
    for entry, value in zip(meta["input_token_logprobs"], prompt_values[3:]):
        assert entry[0] == pytest.approx(value, abs=1e-5)
    assert len(meta["input_top_logprobs"]) == 3 and all(len(top) == 1 for top in meta["input_top_logprobs"])


def test_zero_max_new_tokens_scores_and_primes_the_prompt(tiny_server: ServerProcess) -> None:
    ids = [90 + i for i in range(9)]
    scored = generate(
        tiny_server,
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    assert scored["text"] == "" and scored["output_ids"] == []
    meta = scored["meta_info"]
    assert meta["completion_tokens"] == 0 and meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["output_token_logprobs"] == []
    generated = generate(
        tiny_server,
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 1, **GREEDY},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    for a, b in zip(
        meta["input_token_logprobs"], generated["meta_info"]["input_token_logprobs"], strict=True
    ):
        assert a[1] == b[1] and (a[0] is None) == (b[0] is None)
        if a[0] is not None:
            assert a[0] == pytest.approx(b[0], abs=1e-5)
    # Priming: a prompt-only request puts the prompt's full blocks (block size 4) in the cache.
    primed_ids = [100 + i for i in range(9)]
    first = generate(tiny_server, {"input_ids": primed_ids, "sampling_params": {"max_new_tokens": 0}})
    assert first["meta_info"]["cached_tokens"] == 0 and "input_token_logprobs" not in first["meta_info"]
    after = generate(
        tiny_server, {"input_ids": primed_ids + [120], "sampling_params": {"max_new_tokens": 2, **GREEDY}}
    )
    assert after["meta_info"]["cached_tokens"] == 8


def test_flush_cache_empties_the_prefix_cache(tiny_server: ServerProcess) -> None:
    payload = {"input_ids": [130 + i for i in range(10)], "sampling_params": {"max_new_tokens": 1, **GREEDY}}
    generate(tiny_server, payload)
    assert generate(tiny_server, payload)["meta_info"]["cached_tokens"] == 8
    with tiny_server.http() as http:
        response = http.post("/flush_cache", json={"empty_cache": True})  # RuntimeEndpoint's body
        assert response.status_code == 200 and response.json()["success"] is True
        assert http.post("/flush_cache").status_code == 200  # no body at all
    assert tiny_server.kv()["cached_blocks"] == 0
    assert generate(tiny_server, payload)["meta_info"]["cached_tokens"] == 0


def test_abort_request_ends_a_stream_with_partial_output_and_frees_kv(tiny_server: ServerProcess) -> None:
    payload = {
        "input_ids": [140, 141, 142],
        "sampling_params": {"max_new_tokens": 3000, **GREEDY},
        "rid": "native-abort-stream",
        "stream": True,
    }
    chunks = []
    with tiny_server.http() as http, http.stream("POST", "/generate", json=payload) as response:
        lines = (line for line in response.iter_lines() if line)
        for line in lines:
            chunks.append(line)
            if len(chunks) == 3:
                with tiny_server.paused_in_place():  # so the abort meets a running request
                    aborted = http.post("/abort_request", json={"rid": "native-abort-stream"})
                    assert aborted.status_code == 200 and aborted.json()["num_aborted"] == 1
        assert chunks[-1] == "data: [DONE]"
    last = json.loads(chunks[-2].removeprefix("data: "))
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(last["output_ids"]) < 3000 and last["meta_info"]["completion_tokens"] == len(
        last["output_ids"]
    )
    wait_until(lambda: tiny_server.kv()["num_running"] == 0)
    kv = tiny_server.kv()
    assert kv["blocks_in_use"] == 0 and kv["all_free_or_cached"]


def test_abort_request_ends_a_batch_by_its_rid(tiny_server: ServerProcess) -> None:
    payload = {
        "input_ids": [[150, 151], [152, 153]],
        "sampling_params": {"max_new_tokens": 3000, **GREEDY},
        "rid": "native-abort-batch",
    }

    async def run() -> Any:
        async with tiny_server.async_http() as http:
            request = asyncio.ensure_future(http.post("/generate", json=payload))
            while (await http.get("/v1/admin/kv")).json()["num_running"] < 2:
                await asyncio.sleep(0.01)  # polling for both to start, bounded by the test timeout
            aborted = await http.post("/abort_request", json={"rid": "native-abort-batch"})
            assert aborted.json()["num_aborted"] == 2
            return (await request).json()

    outputs = asyncio.run(asyncio.wait_for(run(), 60))
    assert [o["meta_info"]["id"] for o in outputs] == ["native-abort-batch_0", "native-abort-batch_1"]
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outputs)
    assert all(len(o["output_ids"]) < 3000 for o in outputs)
    wait_until(lambda: tiny_server.kv()["num_running"] == 0)
    assert tiny_server.kv()["all_free_or_cached"]
    with tiny_server.http() as http:
        assert http.post("/abort_request", json={"rid": "no-such-request"}).json()["num_aborted"] == 0


def test_stop_and_structured_outputs(tiny_server: ServerProcess) -> None:
    base = generate(
        tiny_server, {"input_ids": [160, 161], "sampling_params": {"max_new_tokens": 6, **GREEDY}}
    )
    third = base["output_ids"][2]
    stopped = generate(
        tiny_server,
        {
            "input_ids": [160, 161],
            "sampling_params": {"max_new_tokens": 6, "stop_token_ids": [third], **GREEDY},
        },
    )
    assert stopped["output_ids"] == base["output_ids"][:3]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": third}
    stop_text = f"<{base['output_ids'][1]}>"
    by_string = generate(
        tiny_server,
        {"input_ids": [160, 161], "sampling_params": {"max_new_tokens": 6, "stop": [stop_text], **GREEDY}},
    )
    assert by_string["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_text}
    assert stop_text not in by_string["text"]
    kept = generate(
        tiny_server,
        {
            "input_ids": [160, 161],
            "sampling_params": {"max_new_tokens": 6, "stop": [stop_text], "no_stop_trim": True, **GREEDY},
        },
    )
    assert kept["text"].endswith(stop_text)
    constrained = generate(
        tiny_server,
        {
            "text": words([162]),
            "sampling_params": {"max_new_tokens": 4, "regex": "(<7>){2}", "temperature": 0},
        },
    )
    # The grammar sees the tiny tokenizer's token strings ("<7>"), which decode with spaces between.
    assert constrained["output_ids"][:2] == [7, 7]
    assert constrained["meta_info"]["finish_reason"]["type"] == "stop"


# ---------------------------------------------------------------------------------------------------
# what RuntimeEndpoint sends


def test_runtime_endpoint_request_shapes(tiny_server: ServerProcess) -> None:
    """The bodies ``sglang.lang``'s ``RuntimeEndpoint`` posts: every sampling field present, most null."""
    srt_kwargs = {
        "max_new_tokens": 4,
        "min_new_tokens": 0,
        "n": 1,
        "stop": [],
        "stop_token_ids": None,
        "stop_regex": None,
        "temperature": 0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "ignore_eos": False,
        "regex": None,
        "json_schema": None,
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
    }
    prefix = words([170, 171, 172])
    with tiny_server.http() as http:
        info = http.get("/get_model_info").json()
        assert info["model_path"] and info["is_generation"] is True
        assert http.get("/get_server_info").status_code == 200
        assert http.post("/flush_cache", json={"empty_cache": True}).status_code == 200
        primed = http.post("/generate", json={"text": prefix, "sampling_params": {"max_new_tokens": 0}})
        assert primed.status_code == 200
        prompt_len = primed.json()["meta_info"]["prompt_tokens"]
        gen = http.post(
            "/generate",
            json={
                "text": prefix,
                "sampling_params": srt_kwargs,
                "return_logprob": True,
                "top_logprobs_num": 1,
            },
        )
        assert gen.status_code == 200 and gen.json()["meta_info"]["completion_tokens"] >= 1
        # select(): the choices' logprobs, prompt only, with token healing's start two tokens back.
        choices = [" <173>", " <174> <175>"]
        select = http.post(
            "/generate",
            json={
                "text": [prefix + c for c in choices],
                "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                "return_logprob": True,
                "return_text_in_logprobs": True,
                "logprob_start_len": max(prompt_len - 2, 0),
            },
        )
    assert select.status_code == 200
    results = select.json()
    assert [len(r["meta_info"]["input_token_logprobs"]) for r in results] == [3, 4]
    for result in results:
        entries = result["meta_info"]["input_token_logprobs"]
        assert all(e[0] is not None and e[0] <= 0 for e in entries)
        assert entries[0][2] == "<171>" and result["meta_info"]["output_token_logprobs"] == []


# ---------------------------------------------------------------------------------------------------
# info, health, errors


def test_model_and_server_info(tiny_server: ServerProcess) -> None:
    with tiny_server.http() as http:
        model = http.get("/model_info").json()
        assert model == http.get("/get_model_info").json()
        server = http.get("/server_info").json()
        assert server == http.get("/get_server_info").json()
    assert model["is_generation"] is True and model["weight_version"] == "default"
    assert model["tokenizer_path"] == model["model_path"] and model["architectures"] == ["LlamaForCausalLM"]
    assert server["num_kv_blocks"] == 2048 and server["block_size"] == server["page_size"] == 4
    assert server["max_total_num_tokens"] == 8192
    assert server["max_model_len"] == server["context_length"] == 4096
    assert server["engine_config"]["cache"]["block_size"] == 4
    assert server["engine_config"]["scheduler"]["max_num_batched_tokens"] == 256
    assert server["server_settings"]["served_model_names"] == ["tiny"]
    assert (
        "api_keys" not in server["server_settings"] and server["server_settings"]["api_key_required"] is True
    )
    assert tiny_server.api_key not in json.dumps(server)


def test_health_generate_encode_and_the_api_key(tiny_server: ServerProcess) -> None:
    with tiny_server.http() as http:
        assert http.get("/health_generate").status_code == 200
        encode = http.post("/encode", json={"text": "hello"})
        assert encode.status_code == 400 and encode.json()["error"]["code"] == "not_an_embedding_model"
    with httpx.Client(base_url=tiny_server.base_url, timeout=30) as anonymous:
        for method, path in (("POST", "/generate"), ("GET", "/model_info"), ("GET", "/health_generate")):
            response = anonymous.request(method, path, json={"text": "x"} if method == "POST" else None)
            assert response.status_code == 401


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"text": "<5>", "frobnicate": 1}, "frobnicate"),
        ({"text": "<5>", "input_ids": [5]}, "text"),
        ({"sampling_params": {"max_new_tokens": 2}}, "text"),
        ({"input_ids": []}, "input_ids"),
        ({"text": []}, "text"),
        ({"text": "<5>", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
        ({"text": "<5>", "sampling_params": {"temperatur": 1}}, "sampling_params.temperatur"),
        ({"text": "<5>", "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        (
            {"text": "<5>", "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}},
            "sampling_params.min_new_tokens",
        ),
        ({"text": "<5>", "sampling_params": {"regex": "("}}, "sampling_params.regex"),
        ({"text": "<5>", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "sampling_params.ebnf"),
        ({"text": "<5>", "sampling_params": {"stop_regex": "a"}}, "sampling_params.stop_regex"),
        ({"text": ["<5>", "<6>"], "sampling_params": [{"n": 1}, {"n": 2}]}, "sampling_params.n"),
        ({"text": ["<5>", "<6>"], "rid": ["a"]}, "rid"),
        ({"text": ["<5>", "<6>"], "rid": ["a", "a"]}, "rid"),
        ({"text": "<5>", "return_logprob": True, "top_logprobs_num": 50}, "top_logprobs_num"),
        ({"text": "<5> <6>", "return_logprob": True, "logprob_start_len": 2}, "logprob_start_len"),
        ({"text": "<5>", "image_data": "http://x/cat.png"}, "image_data"),
        ({"input_ids": [5, 999]}, "input_ids"),
    ],
)
def test_bad_generate_bodies_are_400_naming_the_field(
    tiny_server: ServerProcess, payload: dict[str, Any], param: str
) -> None:
    body = generate(tiny_server, payload, status=400)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert param.rsplit(".", 1)[-1] in error["message"] or param == "input_ids"


def test_abort_request_and_flush_cache_bad_bodies(tiny_server: ServerProcess) -> None:
    with tiny_server.http() as http:
        assert http.post("/abort_request", json={}).status_code == 400
        assert http.post("/abort_request", json={"rid": "x", "extra": 1}).status_code == 400
        assert http.post("/flush_cache", json={"unknown": 1}).status_code == 400
