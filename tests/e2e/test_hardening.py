"""A careless or hostile client cannot knock the server over or hurt anyone else's request.

One server of this module's own, with short header and body deadlines: invalid Unicode and
out-of-range numbers are 400s; no error closes a keep-alive connection; bodies over the limit are
413s; slow-loris clients are cut off; 1,000 idle connections do not stop others being served; and
fuzzed bodies on every route never get a 5xx.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_process import TINY_ARGS, ServerProcess
from tiny_model import words

PROMPT = words([5, 6, 7, 8])
HEADER_TIMEOUT = 1.5
BODY_TIMEOUT = 1.5
BODY_LIMIT = 100_000
GOOD = ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2})


@pytest.fixture(scope="module")
def server(tiny_model_dir: str) -> Iterator[ServerProcess]:
    args = [
        *TINY_ARGS,
        "--served-model-name",
        "tiny",
        "--header-timeout",
        str(HEADER_TIMEOUT),
        "--body-timeout",
        str(BODY_TIMEOUT),
        "--max-request-body-bytes",
        str(BODY_LIMIT),
    ]
    process = ServerProcess(tiny_model_dir, args)
    yield process
    process.stop()


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


def client_port(response: httpx.Response) -> int:
    """The client-side port of the connection that carried ``response`` (same port: same connection)."""
    return int(response.extensions["network_stream"].get_extra_info("client_addr")[1])


def post_raw(http: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return http.post(path, content=body, headers={"content-type": "application/json"})


def assert_connection_kept(http: httpx.Client, bad: httpx.Response) -> None:
    """A good request after ``bad`` on the same client succeeds over the very same connection."""
    good = http.post(GOOD[0], json=GOOD[1])
    assert good.status_code == 200, good.text
    assert client_port(good) == client_port(bad)


# ---------------------------------------------------------------------------------------------------
# invalid Unicode


@pytest.mark.parametrize(
    ("path", "body", "where"),
    [
        ("/v1/completions", b'{"model": "\\ud800", "prompt": "<5>"}', "model"),
        ("/v1/completions", b'{"prompt": "<5> \\ud800", "max_tokens": 2}', "prompt"),
        ("/v1/completions", b'{"prompt": ["<5>", "\\udfff <6>"], "max_tokens": 2}', "prompt.1"),
        ("/v1/completions", b'{"prompt": "<5>", "stop": ["x", "\\ud800"]}', "stop.1"),
        ("/v1/completions", b'{"prompt": "<5>", "user": "\\udc00abc"}', "user"),
        ("/v1/completions", b'{"prompt": "<5>", "\\ud800": 1}', "the body"),
        ("/v1/completions", b'{"prompt": "<5>", "logit_bias": {"\\ud801": 1}}', "logit_bias"),
        ("/v1/completions", b'{"prompt": "<5>", "cache_salt": "\\ud83d"}', "cache_salt"),
        ("/v1/completions", '{"prompt": "<5> \udc80"}'.encode("utf-8", "surrogatepass"), "prompt"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            b'{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}',
            "model",
        ),
        ("/tokenize", b'{"prompt": "\\udbff"}', "prompt"),
        ("/detokenize", b'{"model": "\\ud800", "tokens": [5]}', "model"),
    ],
)
def test_invalid_unicode_is_a_400_and_keeps_the_connection(
    server: ServerProcess, path: str, body: bytes, where: str
) -> None:
    with server.http() as http:
        bad = post_raw(http, path, body)
        error = error_of(bad, 400)
        assert error["code"] == "invalid_unicode"
        assert f"in {where}:" in error["message"] and "surrogate" in error["message"]
        assert_connection_kept(http, bad)


def test_surrogate_pairs_and_escaped_backslashes_are_fine(server: ServerProcess) -> None:
    with server.http() as http:
        # A proper pair is one emoji; "\\ud800" is a backslash and five letters: both valid text.
        text = b'"<5> \\ud83d\\ude00 \\\\ud800"'
        response = post_raw(http, "/tokenize", b'{"prompt": ' + text + b"}")
        assert response.status_code == 200, response.text
        completion = post_raw(http, "/v1/completions", b'{"max_tokens": 2, "prompt": ' + text + b"}")
        assert completion.status_code == 200, completion.text


# ---------------------------------------------------------------------------------------------------
# numbers out of range, and every other error, keep the connection


OUT_OF_RANGE: list[tuple[str, dict[str, Any], str | None]] = [
    ("/v1/completions", {"prompt": PROMPT, "n": 0}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "n": 10**30}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "n": 2, "best_of": 1}, "best_of"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 10**30}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 100}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "seed": 10**30}, "seed"),
    ("/v1/completions", {"prompt": PROMPT, "priority": 10**30}, "priority"),
    ("/v1/completions", {"prompt": PROMPT, "top_k": 10**30}, None),
    ("/v1/completions", {"prompt": PROMPT, "min_tokens": 10**30}, "min_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "stop_token_ids": [10**30]}, None),
    ("/v1/completions", {"prompt": [10**30], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {str(10**30): 1}}, None),
    ("/v1/completions", {"prompt": PROMPT, "temperature": float("nan")}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": float("inf")}, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": -5},
        "max_tokens",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 100},
        "top_logprobs",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": -(10**30)}, "seed"),
    ("/detokenize", {"tokens": [10**30]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
]


@pytest.mark.parametrize(("path", "payload", "param"), OUT_OF_RANGE)
def test_out_of_range_numbers_are_400s(
    server: ServerProcess, path: str, payload: dict[str, Any], param: str | None
) -> None:
    with server.http() as http:
        bad = post_raw(http, path, json.dumps(payload).encode())  # json.dumps writes NaN and Infinity
        error = error_of(bad, 400)
        if param is not None:
            assert error["param"] == param, error
        assert_connection_kept(http, bad)


def test_no_error_closes_a_keep_alive_connection(server: ServerProcess) -> None:
    with server.http() as http:
        cases = [
            (http.post("/v1/completions", json={"model": "gpt-9", "prompt": PROMPT}), 404),
            (http.get("/no-such-route"), 404),
            (http.delete("/v1/completions"), 405),
            (post_raw(http, "/v1/completions", b"{not json"), 400),
            (post_raw(http, "/v1/completions", b"[1, 2]"), 400),
            (post_raw(http, "/v1/completions", b'{"prompt": "' + b"x" * BODY_LIMIT + b'"}'), 413),
            (http.post("/v1/completions", content=iter([b"{", b" " * BODY_LIMIT, b"}"])), 413),
            (http.post("/v1/completions", json={"prompt": [5] * 5000, "max_tokens": 1}), 400),
        ]
        for bad, status in cases:
            error_of(bad, status)
            assert_connection_kept(http, bad)


# ---------------------------------------------------------------------------------------------------
# slow clients and many idle connections


def read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    sock.settimeout(timeout)
    start = time.monotonic()
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received, time.monotonic() - start


def test_slow_loris_headers_are_cut_off(server: ServerProcess) -> None:
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        # Trickle a header line a byte at a time: activity alone does not keep the connection.
        sock.settimeout(0.2)
        closed = False
        for byte in b"X-Slow: " + b"a" * 1000:
            try:
                sock.send(bytes([byte]))
                closed = sock.recv(1) == b""
            except TimeoutError:
                continue
            except OSError:
                closed = True
            if closed:
                break
        elapsed = time.monotonic() - start
    assert closed and elapsed < HEADER_TIMEOUT + 3


def test_silent_connection_is_cut_off(server: ServerProcess) -> None:
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        received, elapsed = read_until_closed(sock, HEADER_TIMEOUT + 5)
    assert received == b"" and elapsed < HEADER_TIMEOUT + 3


def test_slow_body_is_a_408_and_others_are_served_meanwhile(server: ServerProcess) -> None:
    host, port = server.base_url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head.encode() + body[:5])
        with server.http() as http:  # the slow client holds nothing anyone else needs
            assert http.post(GOOD[0], json=GOOD[1]).status_code == 200
        received, elapsed = read_until_closed(sock, BODY_TIMEOUT + 5)
    status_line, _, rest = received.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 408"), received
    assert b"connection: close" in rest.lower()
    assert json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert elapsed < BODY_TIMEOUT + 3


def test_a_thousand_idle_connections_do_not_block_others(server: ServerProcess) -> None:
    host, port = server.base_url.removeprefix("http://").split(":")
    idle: list[socket.socket] = []
    try:
        for _ in range(1000):
            idle.append(socket.create_connection((host, int(port)), timeout=5))
        for sock in idle[:500]:  # half of them also start a request and stall mid-headers
            sock.sendall(b"GET /health HTTP/1.1\r\n")
        start = time.monotonic()
        with server.http() as http:
            response = http.post(GOOD[0], json=GOOD[1])
        assert response.status_code == 200
        assert time.monotonic() - start < 5.0
    finally:
        for sock in idle:
            sock.close()


# ---------------------------------------------------------------------------------------------------
# fuzzing every route's JSON body


def _json_values() -> st.SearchStrategy[Any]:
    # Text includes unpaired surrogates (category Cs), numbers include NaN, infinities and huge ints.
    text = st.text(st.characters(codec=None), max_size=8)
    numbers = st.one_of(
        st.integers(-3, 5),
        st.sampled_from([2**31, 2**63, 2**64, -(2**63) - 1, 10**30]),
        st.floats(allow_nan=True, allow_infinity=True),
    )
    scalars = st.one_of(st.none(), st.booleans(), numbers, text)
    return st.recursive(
        scalars,
        lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(text, inner, max_size=3)),
        max_leaves=6,
    )


SAMPLING_FIELDS = [
    "model", "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos",
    "min_tokens", "stream", "stream_options", "priority", "cache_salt", "user", "service_tier",
    "timeout", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
]  # fmt: skip
ROUTES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "/v1/completions": (
        {"prompt": PROMPT, "max_tokens": 2},
        [*SAMPLING_FIELDS, "prompt", "max_tokens", "logprobs", "echo", "best_of", "suffix"],
    ),
    "/v1/chat/completions": (
        {"messages": [{"role": "user", "content": "<5> <6>"}], "max_tokens": 2},
        [
            *SAMPLING_FIELDS,
            "messages",
            "max_tokens",
            "max_completion_tokens",
            "logprobs",
            "top_logprobs",
            "tools",
            "tool_choice",
            "response_format",
            "chat_template",
            "chat_template_kwargs",
        ],
    ),  # fmt: skip
    "/tokenize": ({"prompt": PROMPT}, ["model", "prompt", "messages", "add_special_tokens"]),
    "/detokenize": ({"tokens": [5, 6]}, ["model", "tokens"]),
}


@st.composite
def fuzzed_request(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A route and a body: its valid base with a few fields replaced by arbitrary JSON."""
    path = draw(st.sampled_from(sorted(ROUTES)))
    base, fields = ROUTES[path]
    body = dict(base)
    for name in draw(st.lists(st.sampled_from([*fields, "unknown_field"]), max_size=3, unique=True)):
        body[name] = draw(_json_values())
    if body.get("max_tokens") is None or body.get("max_tokens") in (True, False):
        body.pop("max_tokens", None)
    if isinstance(body.get("max_tokens"), int) and 0 < body["max_tokens"] < 2**31:
        body["max_tokens"] = min(body["max_tokens"], 8)  # keep the generation itself short
    return path, body


def test_fuzzed_bodies_never_get_a_5xx(server: ServerProcess) -> None:
    with server.http() as http:

        @settings(
            max_examples=150,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(fuzzed_request())
        def check(request: tuple[str, dict[str, Any]]) -> None:
            path, body = request
            response = post_raw(http, path, json.dumps(body).encode())
            assert response.status_code < 500, (path, body, response.text)
            if response.status_code >= 400:
                error_of(response, response.status_code)

        check()
        assert http.get("/health").status_code == 200
        assert http.post(GOOD[0], json=GOOD[1]).status_code == 200
