"""Headless Chromium for the page tests: bench/browser.py's driver (the DevTools protocol over a
pipe, the standard library only; bench_report_page.py times pages with it too), whether a
browser is here, and what every page test checks of a page it opened.
"""

from __future__ import annotations

import os

import pytest

from tests import scripts

_driver = scripts.bench("browser")
DevToolsError = _driver.DevToolsError
Page = _driver.Page
find_chromium = _driver.find_chromium
open_page = _driver.open_page

# ----------------------------------------------------------------------------- for the page tests
BROWSER = find_chromium()
needs_browser = pytest.mark.skipif(
    BROWSER is None,
    reason="no Chromium found (apt-get install chromium, or set GRAPHSAN_CHROMIUM): "
    "the pages were not opened in a browser",
)


def check_page(page, expect: list[str]) -> None:
    """The page raised nothing, logged nothing, fetched nothing from the network, and shows
    every text of `expect`."""
    assert page.errors == [], page.errors
    assert page.console == [], page.console
    assert [u for u in page.requests if not u.startswith(("file://", "data:"))] == []
    for text in expect:
        assert text in page.text, f"{text!r} is not visible on the page"


def screenshot_path(tmp_path, name: str) -> str:
    """Where a test keeps a page's screenshot: $GRAPHSAN_SCREENSHOTS when set, else tmp_path."""
    folder = os.environ.get("GRAPHSAN_SCREENSHOTS") or str(tmp_path)
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, name)
