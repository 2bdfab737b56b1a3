"""tokenmill.lang against a live tokenmill server, compared with the same programs in-process.

``Endpoint`` goes through the native ``/generate``, ``OpenAIEndpoint`` through ``/v1/completions``;
at temperature 0 every primitive must give what the in-process ``Runtime`` gives on the same model.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from server_process import API_KEY, ServerProcess
from tiny_model import words

from tokenmill.lang import Backend, Endpoint, OpenAIEndpoint, Runtime, function, gen, select
from tokenmill.lang.remote import RemoteError

PREFIX = words(list(range(10, 40))) + " "
CHOICES = [words([50, 51]), words([60]), words([70, 71, 72])]


@pytest.fixture(scope="module")
def runtime(tiny_model_dir: str) -> Iterator[Runtime]:
    backend = Runtime(tiny_model_dir, dtype="float32", num_blocks=512, block_size=4, seed=0)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def openai_backend(tiny_server: ServerProcess, tiny_model_dir: str) -> Iterator[OpenAIEndpoint]:
    backend = OpenAIEndpoint(tiny_server.url, api_key=API_KEY, tokenizer=tiny_model_dir)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def native_backend(tiny_server: ServerProcess, tiny_model_dir: str) -> Iterator[Endpoint]:
    backend = Endpoint(tiny_server.base_url, api_key=API_KEY)  # the tokenizer: /get_model_info's path
    yield backend
    backend.close()


@pytest.fixture(params=["native", "openai"])
def remote(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")  # type: ignore[no-any-return]


@function
def pick_and_continue(s, prefix):  # type: ignore[no-untyped-def]
    s += prefix
    s += select("choice", choices=CHOICES)
    s += " "
    s += gen("more", max_tokens=5, temperature=0, ignore_eos=True)


@function
def branches(s):  # type: ignore[no-untyped-def]
    s += PREFIX
    forks = s.fork(2)
    for i, branch in enumerate(forks):
        branch += words([80 + i]) + " "
        branch += gen("tail", max_tokens=4, temperature=0, ignore_eos=True)
    forks.join()
    return [branch["tail"] for branch in forks]


def test_remote_backends_match_the_in_process_runtime(runtime: Runtime, remote: Backend) -> None:
    local = pick_and_continue.run(prefix=PREFIX, backend=runtime)
    state = pick_and_continue.run(prefix=PREFIX, backend=remote)
    assert state["choice"] == local["choice"]
    assert state.get_meta_info("choice")["normalized_logprobs"] == pytest.approx(
        local.get_meta_info("choice")["normalized_logprobs"], abs=1e-4
    )
    assert state["more"] == local["more"] and state.text() == local.text()


def test_remote_fork_primes_and_branches_hit_the_cache(runtime: Runtime, remote: Backend) -> None:
    state = branches.run(backend=remote)
    assert state.ret_value == branches.run(backend=runtime).ret_value
    records = state.trace.records
    assert records[0].kind == "prime" and records[0].prompt_tokens == 30
    assert all(r.cached_tokens >= 28 for r in records[1:])  # the primed prefix's seven full blocks


def test_remote_streams_and_runs_batches(runtime: Runtime, remote: Backend) -> None:
    @function
    def one(s, start):  # type: ignore[no-untyped-def]
        s += words([start, start + 1]) + " "
        s += gen("x", max_tokens=6, temperature=0, ignore_eos=True)

    streamed = one.run(start=90, backend=remote, stream=True)
    assert "".join(streamed.text_iter("x")) == streamed["x"] == one.run(start=90, backend=runtime)["x"]
    states = one.run_batch([{"start": s} for s in (100, 110, 120)], backend=remote, num_threads=3)
    assert [s["x"] for s in states] == [one.run(start=s, backend=runtime)["x"] for s in (100, 110, 120)]


def test_select_without_prompt_logprobs_names_the_missing_feature(tiny_model_dir: str) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "echo is not supported"}})

    backend = OpenAIEndpoint("http://unused/v1", model="m", tokenizer=tiny_model_dir)
    backend.http = httpx.Client(base_url="http://unused/v1", transport=httpx.MockTransport(refuse))

    @function
    def pick(s):  # type: ignore[no-untyped-def]
        s += PREFIX
        s += select("c", choices=CHOICES)

    with pytest.raises(Exception, match="needs prompt logprobs.*echo=true.*echo is not supported") as info:
        pick.run(backend=backend)
    assert isinstance(info.value.__cause__, RemoteError)


def test_completions_score_a_prompt_with_echo_and_max_tokens_zero(tiny_server: ServerProcess) -> None:
    """Legacy completions' prompt scoring (what OpenAIEndpoint's select sends): nothing generated."""
    prompt = words([5, 6, 7, 8])
    with tiny_server.http() as http:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0}
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["text"] == prompt and choice["finish_reason"] == "length"
        assert reply.json()["usage"]["completion_tokens"] == 0
        logprobs = choice["logprobs"]["token_logprobs"]
        assert len(logprobs) == 4 and logprobs[0] is None and all(v is not None for v in logprobs[1:])
        refused = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 0})
        assert refused.status_code == 400 and "0 only with echo" in refused.json()["error"]["message"]
        chat = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 0}
        assert http.post("/v1/chat/completions", json=chat).status_code == 400
