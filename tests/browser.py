"""Headless Chromium for tests: Debian's `chromium` and `chromium-driver`, driven by Selenium.

Nothing is downloaded at test time. On a developer's machine without them the browser tests
skip; under AUTOTUNE_REQUIRE_BROWSER=1 (CI: `.ci/run` installs both and sets it) they fail.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

import pytest

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
DRIVER = ("/usr/bin/chromedriver",)
# This closed network answers nothing: no update checks, no QUIC, no sync, no sandbox (root in CI).
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
)


def missing(what: str) -> NoReturn:
    message = f"{what} (apt-get install chromium chromium-driver; pip install -e '.[test]')"
    if os.environ.get("AUTOTUNE_REQUIRE_BROWSER") == "1":
        pytest.fail(f"AUTOTUNE_REQUIRE_BROWSER=1 but {message}", pytrace=False)
    pytest.skip(message)


def _first(paths: tuple[str, ...]) -> str | None:
    return next((p for p in paths if Path(p).is_file()), None) or shutil.which(Path(paths[0]).name)


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A Selenium driver of headless Chromium with a fresh profile; browser console kept."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing("selenium is not installed")
    binary, driver = _first(CHROMIUM), _first(DRIVER)
    if binary is None or driver is None:
        missing("no chromium or chromedriver")
    profile = tempfile.mkdtemp(prefix="autotune-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    browser = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield browser
    finally:
        browser.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait_for(browser: Any, check: Callable[[], Any], timeout_s: float = 20.0, what: str = "") -> Any:
    """Poll ``check`` until it returns something truthy; fail naming ``what`` after the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            pytest.fail(
                f"{what}: not there after {timeout_s:.0f} s; page text: {browser.find_element('tag name', 'body').text[:500]!r}"
            )
        time.sleep(0.2)


def console_errors(browser: Any) -> list[str]:
    return [e["message"] for e in browser.get_log("browser") if e.get("level") == "SEVERE"]


def plots_rendered(browser: Any) -> int:
    """Plotly figures that drew their SVG."""
    return browser.execute_script(
        "return [...document.querySelectorAll('.js-plotly-plot')].filter(p => p.querySelector('.main-svg')).length"
    )


WINDOW = (1280, 1000)  # the laptop a person reads a report on


def page_width(browser: Any) -> int:
    """How wide the page lays itself out: more than the window is a sideways scroll."""
    return browser.execute_script("return document.documentElement.scrollWidth")


def assert_fits(browser: Any, what: str) -> None:
    """The page is no wider than the window (optuna-dashboard scrolls inside its own panes, so
    a page wider than the window is one whose content forced it)."""
    width = page_width(browser)
    assert width <= WINDOW[0], f"{what} is {width} px wide in a {WINDOW[0]} px window"


def check_report(path: Path, min_plots: int) -> Any:
    """Open a report file and assert that its plots render, it fits the window and the console
    stays clean."""
    with chromium() as browser:
        browser.set_window_size(*WINDOW)
        browser.get(path.resolve().as_uri())
        n = wait_for(
            browser,
            lambda: plots_rendered(browser) >= min_plots and plots_rendered(browser),
            what=f"{min_plots} rendered plots in {path.name}",
        )
        assert not console_errors(browser), console_errors(browser)
        assert_fits(browser, f"the report {path.name}")
        rows = browser.execute_script("return document.querySelectorAll('#trials tbody tr').length")
        winner = browser.find_element("id", "winner").text
        return n, rows, winner
