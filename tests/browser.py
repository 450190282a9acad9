"""A headless Chromium driven by Playwright, for the tests of the HTML pages (dashboards, the graph viewer).

Playwright's own browser download is not reachable here: it drives Debian's ``chromium`` package
(``apt-get install chromium``; ``pip install playwright``). Tests that use it skip, with the reason, where either
is missing.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SIZE = {"width": 1280, "height": 800}


def chromium() -> str:
    """The path of Debian's chromium (skips the test where there is none)."""
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("no chromium installed (Debian: apt-get install chromium)")


@dataclass
class Browser:
    """A launched browser; :meth:`page` opens a 1280x800 page whose console errors land in ``errors``."""

    browser: Any
    errors: list[str] = field(default_factory=list)

    def page(self, url: str) -> Any:
        """A new page at ``url`` (1280x800), its console errors and uncaught exceptions recorded."""
        page = self.browser.new_page(viewport=SIZE)
        page.on("console", lambda message: self.errors.append(message.text) if message.type == "error" else None)
        page.on("pageerror", lambda error: self.errors.append(str(error)))
        page.goto(url)
        return page


@contextmanager
def launched() -> Iterator[Browser]:
    """Headless chromium under Playwright (skips with the reason where either is missing)."""
    executable = chromium()
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install playwright)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=ARGS)
        try:
            yield Browser(browser)
        finally:
            browser.close()


def page_data(page: str, name: str) -> Any:
    """The JSON a page holds in ``const <name> = ...;`` (one line)."""
    match = re.search(rf"^const {name} = (.*);$", page, re.M)
    assert match, f"no `const {name} = ...;` line in the page"
    return json.loads(match[1])
