"""The chat playground at ``GET /`` in a real browser (headless Chromium), against the shared tiny
server (which needs an API key) and, once, SmolLM2 where the answer must make sense.

One browser for the module; each test opens a fresh context (its own storage) unless it continues
the previous page's conversation.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from browser import csp_violations, launch_browser, open_page
from server_process import API_KEY, TINY_ARGS, ServerProcess, wait_until

LAST_ANSWER = "#messages > .message.assistant:last-child"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    yield from launch_browser()


@pytest.fixture(scope="module")
def chat(browser: Any, tiny_server: ServerProcess) -> Iterator[Any]:
    """One page on the tiny server's chat, signed in with the key; tests continue its conversation."""
    page, events = open_page(browser, accept_dialogs=True)
    page.goto(tiny_server.base_url + "/")
    enter_key(page, API_KEY)
    page.wait_for_function("() => document.querySelector('#set-model').options.length > 0")
    page.click("#toggle-settings")
    yield page
    assert not events.errors and not csp_violations(page)
    assert all(dialog.startswith("confirm: Delete") for dialog in events.dialogs)  # only the one asked for
    page.context.close()


def enter_key(page: Any, key: str) -> None:
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-input", key)
    page.click("#key-save")


def set_setting(page: Any, selector: str, value: str) -> None:
    """Fill a settings field and fire its change event (the page saves settings on change)."""
    if page.eval_on_selector(selector, "e => e.tagName") == "SELECT":
        page.select_option(selector, value)
    else:
        page.fill(selector, value)
        page.dispatch_event(selector, "change")


def send(page: Any, text: str) -> Any:
    """Type ``text``, press Enter, wait for the answer to end; returns the answer's element."""
    count = page.locator(".message.assistant").count()
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    page.wait_for_function(f"() => document.querySelectorAll('.message.assistant').length > {count}")
    page.wait_for_selector(f"{LAST_ANSWER}:not(.streaming)")
    return page.locator(LAST_ANSWER)


def api_answer(server: ServerProcess, messages: list[dict[str, str]], **fields: Any) -> tuple[str, int]:
    """The same question through the API: the answer's text and its token count."""
    with server.http() as http:
        response = http.post("/v1/chat/completions", json={"messages": messages, **fields})
        response.raise_for_status()
        body = response.json()
        return str(body["choices"][0]["message"]["content"]), int(body["usage"]["completion_tokens"])


def test_pages_are_public_but_the_api_needs_the_key(tiny_server: ServerProcess) -> None:
    for path in ("/", "/dashboard", "/webui/chat.js", "/webui/style.css"):
        response = httpx.get(tiny_server.base_url + path)
        assert response.status_code == 200, path
        assert "script-src 'self'" in response.headers["content-security-policy"]
    for path in ("/metrics.json", "/v1/models"):
        assert httpx.get(tiny_server.base_url + path).status_code == 401
    assert httpx.get(tiny_server.base_url + "/webui/secret.txt").status_code == 404


def test_a_wrong_key_is_asked_again_and_the_key_stays_in_the_session(
    browser: Any, tiny_server: ServerProcess
) -> None:
    page, events = open_page(browser)
    page.goto(tiny_server.base_url + "/")
    enter_key(page, "wrong-key")
    enter_key(page, API_KEY)  # the models call got 401: the dialog is back
    page.wait_for_function("() => document.querySelector('#set-model').options.length > 0")
    assert page.eval_on_selector("#set-model", "e => e.value") == "tiny"
    assert page.evaluate("sessionStorage.getItem('tokenmill.apiKey')") == API_KEY
    assert page.evaluate("localStorage.getItem('tokenmill.apiKey')") is None  # "remember" was not ticked
    assert not events.errors and not events.dialogs
    page.context.close()


def test_the_settings_say_whether_the_server_is_deterministic(
    browser: Any, chat: Any, tiny_model_dir: str
) -> None:
    """The shared server runs in the default mode: no note. A ``--deterministic`` server's page says
    so and shows the seed unseeded requests sample with; its answers repeat exactly."""
    assert chat.is_hidden("#engine-mode")
    server = ServerProcess(tiny_model_dir, [*TINY_ARGS, "--deterministic", "--seed", "11"])
    try:
        page, events = open_page(browser)
        page.goto(server.base_url + "/")
        page.click("#toggle-settings")
        page.wait_for_selector("#engine-mode:not([hidden])")
        assert "Deterministic mode" in page.inner_text("#engine-mode")
        assert "seed 11" in page.inner_text("#engine-mode")
        assert page.get_attribute("#set-seed", "placeholder") == "11 (server seed)"
        messages = [{"role": "user", "content": "hello there"}]
        first = api_answer(server, messages, temperature=1.0, max_tokens=12)
        assert api_answer(server, messages, temperature=1.0, max_tokens=12) == first
        assert not events.errors and not csp_violations(page)
        page.context.close()
    finally:
        server.stop()


def test_the_answer_streams_token_by_token(chat: Any, tiny_server: ServerProcess) -> None:
    # 400 tokens (~0.3 s on the tiny model): enough steps that the answer arrives in several pieces even
    # when a loaded browser makes the server merge the deltas of a few steps into one chunk.
    set_setting(chat, "#set-temperature", "0")
    set_setting(chat, "#set-max-tokens", "400")
    set_setting(chat, "#set-extra", '{"ignore_eos": true}')
    # Record the answer's text length at every change of the page.
    chat.evaluate(
        """() => {
        window.__lengths = [];
        new MutationObserver(() => {
            const answers = document.querySelectorAll('.message.assistant .body');
            if (answers.length) window.__lengths.push(answers[answers.length - 1].textContent.length);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    }"""
    )
    answer = send(chat, "<5> <6> <7>")
    lengths = chat.evaluate("window.__lengths")
    text = answer.locator(".body").inner_text().strip()
    set_setting(chat, "#set-extra", "")
    expected, num_tokens = api_answer(
        tiny_server,
        [{"role": "user", "content": "<5> <6> <7>"}],
        temperature=0,
        max_tokens=400,
        ignore_eos=True,
    )
    assert text == expected and num_tokens == 400
    partial = sorted({n for n in lengths if 0 < n < len(text)})
    assert len(partial) >= 4, f"the answer did not appear piece by piece: {lengths}"
    meta = answer.locator(".meta").inner_text()
    assert "TTFT" in meta and "tok/s" in meta and f"{num_tokens} tokens" in meta and "tier default" in meta
    assert "prompt tokens cached" in meta


def test_stop_ends_the_stream_and_frees_the_engine(chat: Any, tiny_server: ServerProcess) -> None:
    """The engine is paused in place first, so the answer is still streaming whenever the click lands
    (unpaused, the tiny model can finish 3000 tokens before a loaded browser gets to the button)."""
    set_setting(chat, "#set-max-tokens", "3000")
    set_setting(chat, "#set-extra", '{"ignore_eos": true}')
    count = chat.locator(".message.assistant").count()
    with tiny_server.paused_in_place():
        chat.fill("#prompt", "<9> <10>")
        chat.press("#prompt", "Enter")
        chat.wait_for_function(f"() => document.querySelectorAll('.message.assistant').length > {count}")
        wait_until(lambda: tiny_server.metric("tokenmill:num_requests_waiting") == 1)
        chat.click("#stop")
        chat.wait_for_selector(f"{LAST_ANSWER}.done")
        answer = chat.locator(LAST_ANSWER)
        assert "stopped" in answer.locator(".meta").inner_text()
        assert len(answer.locator(".body").inner_text().split()) < 3000
        assert chat.is_hidden("#stop") and chat.is_enabled("#send")
        # The abort reached the engine while it was paused: the request is gone from it.
        wait_until(lambda: tiny_server.metric("tokenmill:num_requests_waiting") == 0)
        assert tiny_server.metric("tokenmill:num_requests_running") == 0
    set_setting(chat, "#set-extra", "")
    set_setting(chat, "#set-max-tokens", "12")
    # The engine serves the next answer.
    assert send(chat, "<9> <10>").locator(".body").inner_text().strip()


def test_service_tier_is_sent_and_the_echo_shown(chat: Any) -> None:
    for tier in ("priority", "flex"):
        set_setting(chat, "#set-tier", tier)
        assert f"tier {tier}" in send(chat, "<11> <12>").locator(".meta").inner_text()
    set_setting(chat, "#set-tier", "")


def test_a_refused_request_shows_the_servers_message(chat: Any) -> None:
    set_setting(chat, "#set-extra", '{"not_a_field": 1}')
    answer = send(chat, "<13>")
    error = answer.locator(".message-error").inner_text()
    assert error.startswith("The request was refused (400)") and "not_a_field" in error
    set_setting(chat, "#set-extra", "")


def test_failures_are_explained_and_a_partial_answer_kept(chat: Any) -> None:
    """A server error, a refused connection and a stream that breaks off (the network is replaced
    by Playwright's routing for this test only)."""
    route = "**/v1/chat/completions"
    error = {"error": {"message": "the engine is not available: gone", "type": "server_error"}}
    chat.route(route, lambda r: r.fulfill(status=503, json=error))
    assert send(chat, "<14>").locator(".message-error").inner_text() == (
        "The server failed (503): the engine is not available: gone."
    )
    chat.unroute(route)
    chat.route(route, lambda r: r.abort("connectionreset"))
    message = "The connection to the server was lost before the answer finished."
    assert send(chat, "<15>").locator(".message-error").inner_text() == message
    chat.unroute(route)
    partial = 'data: {"choices": [{"index": 0, "delta": {"content": "half an"}}]}\n\n'
    chat.route(route, lambda r: r.fulfill(status=200, content_type="text/event-stream", body=partial))
    answer = send(chat, "<16>")
    assert answer.locator(".message-error").inner_text() == message
    assert answer.locator(".body").inner_text() == "half an"
    chat.unroute(route)


def test_regenerate_and_edit_and_resend(chat: Any, tiny_server: ServerProcess) -> None:
    set_setting(chat, "#set-temperature", "0")
    first = send(chat, "<20> <21>").locator(".body").inner_text()
    count = chat.locator(".message").count()
    chat.click("#regenerate")
    chat.wait_for_selector(f"{LAST_ANSWER}.done")
    assert chat.locator(".message").count() == count  # the answer was replaced, not added
    assert chat.locator(LAST_ANSWER).locator(".body").inner_text() == first  # greedy: the same
    # Edit the last question: the conversation is cut there and answered again.
    chat.locator(".message.user >> nth=-1").locator("button.edit").click()
    chat.fill(".edit-box", "<30> <31>")
    chat.click("text=Send edited")
    chat.wait_for_function(f"() => document.querySelectorAll('.message').length === {count}")
    chat.wait_for_selector(f"{LAST_ANSWER}.done")
    assert chat.locator(".message.user >> nth=-1").locator(".body").inner_text() == "<30> <31>"
    stored = chat.evaluate("JSON.parse(localStorage.getItem('tokenmill.chat.v1'))")["conversations"][0]
    history = [
        {"role": m["role"], "content": m["content"]}
        for m in stored["messages"][:-1]
        if not (m["role"] == "assistant" and m.get("error") and not m["content"])  # failed turns are not sent
    ]
    expected, _ = api_answer(tiny_server, history, temperature=0, max_tokens=12)
    assert chat.locator(LAST_ANSWER).locator(".body").inner_text() == expected


def test_reload_keeps_the_conversations(chat: Any) -> None:
    before = chat.locator(".message").all_inner_texts()
    chat.click("#new-chat")
    send(chat, "<40>")
    assert chat.locator("#conversations li").count() == 2
    chat.reload()
    chat.wait_for_selector("body[data-ready]")
    assert chat.locator("#conversations li").count() == 2
    assert chat.locator(".message").count() == 2  # the current (second) conversation
    chat.locator("#conversations li >> nth=1").click()
    assert chat.locator(".message").all_inner_texts() == before
    # Settings survive too.
    assert chat.eval_on_selector("#set-temperature", "e => e.value") == "0"


def test_export_and_delete(chat: Any) -> None:
    with chat.expect_download() as download_info:
        chat.click("#export-chat")
    exported = json.loads(pathlib.Path(download_info.value.path()).read_text())
    assert [m["role"] for m in exported["messages"]][:2] == ["user", "assistant"]
    assert (
        exported["messages"][0]["content"]
        == chat.locator(".message.user >> nth=0").locator(".body").inner_text()
    )
    count = chat.locator("#conversations li").count()
    chat.click("#delete-chat")
    assert chat.locator("#conversations li").count() == count - 1


def test_smollm2_answers_sensibly_and_follows_constraints_in_the_page(
    browser: Any, smollm_server: ServerProcess
) -> None:
    page, events = open_page(browser)
    page.goto(smollm_server.base_url + "/")  # no API key on this server: no dialog
    page.wait_for_function("() => document.querySelector('#set-model').options.length > 0")
    page.click("#toggle-settings")
    set_setting(page, "#set-temperature", "0")
    set_setting(page, "#set-max-tokens", "24")
    answer = send(page, "What is the capital of France?")
    assert "Paris" in answer.locator(".body").inner_text()
    # Constrained output from the settings panel: a JSON schema, then a regular expression.
    schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"]}
    set_setting(page, "#set-constraint", "json_schema")
    set_setting(page, "#set-constraint-text", json.dumps(schema))
    set_setting(page, "#set-max-tokens", "40")
    send(page, "Which city is the capital of France? Answer in JSON.")
    set_setting(page, "#set-constraint", "regex")
    set_setting(page, "#set-constraint-text", "[0-9]{3}-[0-9]{4}")
    send(page, "Make up a phone number.")
    stored = page.evaluate("() => JSON.parse(localStorage.getItem('tokenmill.chat.v1'))")["conversations"][0]
    answers = [m for m in stored["messages"] if m["role"] == "assistant"]
    assert isinstance(json.loads(answers[1]["content"])["capital"], str)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", answers[2]["content"])
    assert not events.errors and not events.dialogs and not csp_violations(page)
    page.context.close()


def test_dashboard_charts_move_under_load(chat: Any, tiny_server: ServerProcess) -> None:
    """The dashboard (same tab: the key is in its session) polls /metrics.json every second; under a
    few streams its request, token-rate and TTFT charts show them."""
    chat.goto(tiny_server.base_url + "/dashboard")
    chat.wait_for_function("() => Number(document.getElementById('chart-requests').dataset.points) >= 2")
    before = chat.eval_on_selector("#chart-tokens", "c => c.toDataURL()")
    body = {"prompt": "<50> <51>", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with tiny_server.http() as http, contextlib.ExitStack() as streams:
        # Three streams held open (closing them at the end aborts them).
        responses = [
            streams.enter_context(http.stream("POST", "/v1/completions", json={**body, "service_tier": tier}))
            for tier in ("default", "flex", "default")
        ]
        # Frozen in place until the page has polled them running (three streams of the tiny model end
        # in ~3 s, which a loaded browser's once-a-second polls can miss).
        wait_until(lambda: tiny_server.metric("tokenmill:num_requests_running") == 3)
        with tiny_server.paused_in_place():
            chat.wait_for_function(
                "() => JSON.parse(document.getElementById('chart-requests').dataset.last).running > 0"
            )
        chat.wait_for_function(
            "() => JSON.parse(document.getElementById('chart-tokens').dataset.last)['tok/s'] > 0"
        )
        chat.wait_for_function(
            "() => 'flex p99' in JSON.parse(document.getElementById('chart-ttft').dataset.last)"
        )
    assert all(response.status_code == 200 for response in responses)
    assert chat.eval_on_selector("#chart-tokens", "c => c.toDataURL()") != before
    assert float(chat.inner_text("#tile-generated").replace(",", "")) > 0
