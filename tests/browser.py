"""Headless Chromium for the trace viewer's tests and screenshots: Debian's ``chromium``
package driven by Playwright from PyPI (never Playwright's own browser download).

``chromium_or_skip()`` returns the browser path or skips the calling test naming what is
missing and how to install it (``make browser`` installs Debian's package where apt-get
and root are available; the test extra installs Playwright).
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager

import pytest

CHROMIUM = os.environ.get("NANOVLLM_CHROMIUM", "/usr/bin/chromium")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
    "--disable-quic",
]


def chromium_path() -> str | None:
    return CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")


def chromium_or_skip() -> str:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("the Python package playwright is not installed (pip install -e '.[test]')")
    path = chromium_path()
    if path is None:
        pytest.skip(
            f"no Chromium at {CHROMIUM} or on PATH: Debian's package 'chromium' is not installed "
            f"(`make browser` installs it with apt-get, which needs root)"
        )
    return path


@contextmanager
def browser_page(executable: str, width: int = 1200, height: int = 760):
    """A fresh page; page errors and console errors are collected in ``page.errors``."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=FLAGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.errors = []
            page.on("pageerror", lambda e: page.errors.append(str(e)))
            page.on("console", lambda m: page.errors.append(m.text) if m.type == "error" else None)
            yield page
        finally:
            browser.close()
