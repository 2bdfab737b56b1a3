"""The chat page never runs what a model writes, in a real browser.

A scripted model (``scripted_model.py``) answers with literal ``<script>``, ``<img onerror=...>``,
``<svg onload=...>``, ``javascript:`` links and a code block that tries to close itself: every attack
would set ``window.__pwned`` or open a dialog. The page must show them as text, with no such element
or attribute in the DOM, no dialog and no Content-Security-Policy violation (nothing even tried).
The same server shows reasoning as a thinking block and tool calls as such.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from browser import csp_violations, launch_browser, open_page
from scripted_model import build_scripted_model
from server_process import TINY_ARGS, ServerProcess

ATTACKS = [
    "<script>window.__pwned=1;alert(1)</script>",
    "<img",
    "src=x",
    "onerror=window.__pwned=2;alert(2)>",
    "<svg/onload=window.__pwned=3>",
    "[click](javascript:window.__pwned=4)",
    '<a href="javascript:window.__pwned=5">link</a>',
    "\n```html\n</code></pre><script>window.__pwned=6</script>\n```\n",
    "<iframe/src=javascript:alert(7)>",
    "**bold**",
]
SCRIPTS = {
    "evil?": ATTACKS,
    "think?": [
        "<think>",
        "Checking",
        "the",
        "weather.",
        "</think>",
        "<tool_call>",
        '{"name": "get_weather",',
        '"arguments": {"city": "Paris"}}',
        "</tool_call>",
    ],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
DANGEROUS_NODES = """(root) => {
    const found = [];
    for (const node of root.querySelectorAll('*')) {
        if (['SCRIPT', 'IMG', 'SVG', 'IFRAME', 'OBJECT', 'EMBED', 'STYLE', 'LINK'].includes(node.tagName.toUpperCase()))
            found.push(node.tagName);
        for (const attribute of node.attributes) {
            if (attribute.name.startsWith('on')) found.push(attribute.name);
            if (/^\\s*javascript:/i.test(attribute.value)) found.push(attribute.name + '=' + attribute.value);
        }
    }
    return found;
}"""


@pytest.fixture(scope="module")
def scripted_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = str(tmp_path_factory.mktemp("scripted-webui-model"))
    build_scripted_model(path, SCRIPTS)
    args = [
        *TINY_ARGS,
        "--served-model-name",
        "scripted",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
    ]
    server = ServerProcess(path, args)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def page(scripted_server: ServerProcess) -> Iterator[Any]:
    for browser in launch_browser():
        page, events = open_page(browser)
        page.goto(scripted_server.base_url + "/")
        page.wait_for_function("() => document.querySelector('#set-model').options.length > 0")
        yield page
        assert not events.errors and not events.dialogs, (events.errors, events.dialogs)
        assert not csp_violations(page)


def ask(page: Any, text: str) -> Any:
    count = page.locator(".message.assistant.done, .message.assistant.failed").count()
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    page.wait_for_function(
        f"() => document.querySelectorAll('.message.assistant.done, .message.assistant.failed').length > {count}"
    )
    return page.locator("#messages > .message.assistant:last-child")


def test_a_malicious_answer_is_shown_not_run(page: Any) -> None:
    answer = ask(page, "please answer evil?")
    text = answer.locator(".body").inner_text()
    assert "<script>window.__pwned=1;alert(1)</script>" in text  # shown as text
    assert "<img src=x onerror=window.__pwned=2;alert(2)>" in text
    assert "</code></pre><script>window.__pwned=6</script>" in answer.locator("pre code").inner_text()
    assert answer.locator(".body strong").inner_text() == "bold"  # Markdown still works
    assert answer.locator(".body a").count() == 0  # no javascript: link became a link
    assert answer.evaluate(DANGEROUS_NODES) == []
    assert page.evaluate("() => window.__pwned === undefined")
    # Reloading renders the stored answer again: still inert.
    page.reload()
    page.wait_for_selector("#messages > .message.assistant:last-child .body strong")
    assert page.locator("#messages").evaluate(DANGEROUS_NODES) == []
    assert page.evaluate("() => window.__pwned === undefined")


def test_the_renderer_escapes_every_attack(page: Any) -> None:
    """markdown.js on its own, with attacks a stream could split anywhere (every prefix)."""
    source = "\n".join(
        [
            *ATTACKS,
            '[ok](https://example.com/?a=1&b="x" onmouseover=alert(1))',
            '[q](https://example.com/"onmouseover="alert(1))',
            "`<b>code</b>` and <b>bold</b> &amp; <!-- comment -->",
            "| a | b |\n|---|---|\n| <img src=x onerror=alert(9)> | [x](javascript:alert(1)) |",
            "> <script>alert(10)</script>",
            "- <svg onload=alert(11)>\n1. <details open ontoggle=alert(12)>",
            "# <h1 onclick=alert(13)>",
        ]
    )
    results = page.evaluate(
        """async (source) => {
            const { renderMarkdown } = await import('/webui/markdown.js');
            const out = [];
            for (let end = 1; end <= source.length; end += 7) {
                const template = document.createElement('template');
                template.innerHTML = renderMarkdown(source.slice(0, end));
                for (const node of template.content.querySelectorAll('*')) {
                    const allowed = ['P', 'BR', 'CODE', 'PRE', 'SPAN', 'STRONG', 'EM', 'DEL', 'A', 'H1', 'H2', 'H3',
                        'H4', 'H5', 'H6', 'UL', 'OL', 'LI', 'BLOCKQUOTE', 'HR', 'TABLE', 'THEAD', 'TBODY', 'TR', 'TH', 'TD'];
                    if (!allowed.includes(node.tagName)) out.push(node.tagName);
                    for (const a of node.attributes) {
                        if (!['class', 'href', 'target', 'rel', 'start'].includes(a.name)) out.push(a.name);
                        if (a.name === 'href' && !/^(https?:\\/\\/|mailto:)/.test(a.value)) out.push(a.value);
                    }
                }
            }
            return out;
        }""",
        source,
    )
    assert results == []
    rendered = page.evaluate(
        """async () => {
            const { renderMarkdown } = await import('/webui/markdown.js');
            return renderMarkdown('**b** _i_ `c` [t](https://e.com) ~~s~~\\n```python\\ndef f(x):  # c\\n    return "s" + 1\\n```');
        }"""
    )
    assert "<strong>b</strong>" in rendered and "<em>i</em>" in rendered and "<code>c</code>" in rendered
    assert '<a href="https://e.com" target="_blank" rel="noopener noreferrer nofollow">t</a>' in rendered
    assert (
        '<span class="tok-keyword">def</span>' in rendered
        and '<span class="tok-comment"># c</span>' in rendered
    )
    assert (
        '<span class="tok-string">&quot;s&quot;</span>' in rendered
        and '<span class="tok-number">1</span>' in rendered
    )


def test_the_policy_blocks_inline_script_and_reports_it(page: Any, scripted_server: ServerProcess) -> None:
    """The second wall, and proof that the violation check above can fail: a script element put into
    the page by hand (as a renderer bug would) neither runs nor goes unreported."""
    other, events = open_page(page.context.browser)
    other.goto(scripted_server.base_url + "/")
    other.wait_for_selector("body[data-ready]")
    other.evaluate(
        """() => {
        const script = document.createElement('script');
        script.textContent = 'window.__inline = 1';
        document.body.append(script);
        const image = document.createElement('img');
        image.src = 'https://example.com/x.png';
        document.body.append(image);
    }"""
    )
    other.wait_for_function("() => window.__cspViolations.length >= 2")
    assert other.evaluate("() => window.__inline === undefined")
    violations = csp_violations(other)
    assert any(v.startswith("script-src") and "inline" in v for v in violations), violations
    assert any(v.startswith("img-src") and "example.com" in v for v in violations), violations
    assert not events.errors and not events.dialogs
    other.context.close()


def test_reasoning_and_tool_calls_are_shown_as_such(page: Any) -> None:
    page.click("#toggle-settings")
    page.fill("#set-tools", json.dumps(TOOLS))
    page.dispatch_event("#set-tools", "change")
    answer = ask(page, "please answer think?")
    assert answer.locator(".message-error").inner_text() == ""
    thinking = answer.locator("details.reasoning")
    assert thinking.is_visible() and thinking.get_attribute("open") is None  # collapsed
    assert answer.locator(".reasoning-body").text_content() == "Checking the weather."
    thinking.locator("summary").click()
    assert answer.locator(".reasoning-body").is_visible()
    assert answer.locator(".tool-name").inner_text() == "tool call: get_weather"
    assert json.loads(answer.locator(".tool-call pre").inner_text()) == {"city": "Paris"}
    assert "finish: tool_calls" in answer.locator(".meta").inner_text()
