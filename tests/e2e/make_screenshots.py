"""Take the README's screenshots of the web UI (docs/webui-chat.png, docs/webui-dashboard.png).

Run from the repository root: ``PYTHONPATH=. python tests/e2e/make_screenshots.py``. It starts
SmolLM2 (``tokenmill serve smollm2-135m``), asks the chat page for a small Python function, then opens
the dashboard while a few streams of two service tiers run, and saves both pages as PNG.
"""

from __future__ import annotations

import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))

import httpx  # noqa: E402
from browser import launch_browser, open_page  # noqa: E402
from server_process import ServerProcess  # noqa: E402

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs")
QUESTION = "Write a short Python function that checks whether a number is prime."


def load(server: ServerProcess, stop: threading.Event, tier: str, max_tokens: int) -> None:
    """Stream questions one after another until ``stop`` is set."""
    body = {"max_tokens": max_tokens, "stream": True, "service_tier": tier, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=120.0) as http:
        while not stop.is_set():
            messages = [{"role": "user", "content": f"Tell me a story about the number {time.time():.0f}."}]
            with http.stream("POST", "/v1/chat/completions", json={**body, "messages": messages}) as response:
                for _ in response.iter_lines():
                    if stop.is_set():
                        break


def main() -> None:
    server = ServerProcess("smollm2-135m", ["--log-level", "warning", "--max-model-len", "2048"])
    try:
        for browser in launch_browser():
            page, _ = open_page(browser)
            page.set_viewport_size({"width": 1280, "height": 760})
            page.goto(server.base_url + "/")
            page.wait_for_function("() => document.querySelector('#set-model').options.length > 0")
            page.click("#toggle-settings")
            page.fill("#set-temperature", "0")
            page.dispatch_event("#set-temperature", "change")
            page.fill("#set-max-tokens", "170")
            page.dispatch_event("#set-max-tokens", "change")
            page.fill("#set-system", "You are a helpful assistant. Answer briefly, with Markdown.")
            page.dispatch_event("#set-system", "change")
            page.fill("#prompt", QUESTION)
            page.press("#prompt", "Enter")
            page.wait_for_selector("#messages > .message.assistant.done", timeout=300_000)
            page.screenshot(path=os.path.join(DOCS, "webui-chat.png"))

            stop = threading.Event()
            workers = [
                threading.Thread(target=load, args=(server, stop, tier, tokens))
                for tier, tokens in [("priority", 60), ("default", 120), ("default", 200), ("flex", 160)]
            ]
            page.goto(server.base_url + "/dashboard")
            for worker in workers:
                worker.start()
                time.sleep(3)
            time.sleep(30)
            page.screenshot(path=os.path.join(DOCS, "webui-dashboard.png"), full_page=True)
            stop.set()
            for worker in workers:
                worker.join()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
