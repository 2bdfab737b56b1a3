"""Headless Chromium for the web UI's end-to-end tests: Debian's ``/usr/bin/chromium`` driven by
Playwright for Python (``make test`` installs both; ``playwright install`` is never needed).

``open_page`` gives a page that records what must never happen on our pages: uncaught errors,
JavaScript dialogs a test did not expect, and Content-Security-Policy violations.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# Every page gets this first: CSP violations are counted where tests can read them.
RECORD_VIOLATIONS = """
window.__cspViolations = [];
document.addEventListener('securitypolicyviolation',
    (e) => window.__cspViolations.push(e.violatedDirective + ' ' + e.blockedURI));
"""


def launch_browser() -> Iterator[Any]:
    """A Chromium for one test module (a generator for a module-scoped fixture)."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is not installed (make test installs it: apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@dataclass
class PageEvents:
    """What happened on a page that tests assert never does."""

    errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)


def open_page(browser: Any, accept_dialogs: bool = False) -> tuple[Any, PageEvents]:
    """A fresh browser context's page (its own storage) and its recorded events. Dialogs are
    dismissed (or accepted) and recorded."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    context.add_init_script(RECORD_VIOLATIONS)
    page = context.new_page()
    page.set_default_timeout(30_000)
    events = PageEvents()
    page.on("pageerror", lambda error: events.errors.append(str(error)))

    def on_dialog(dialog: Any) -> None:
        events.dialogs.append(f"{dialog.type}: {dialog.message}")
        dialog.accept() if accept_dialogs else dialog.dismiss()

    page.on("dialog", on_dialog)
    return page, events


def csp_violations(page: Any) -> list[str]:
    return list(page.evaluate("window.__cspViolations"))
