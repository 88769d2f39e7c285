"""Headless Chromium for the tests that look at a page as a user would (Flower, the docs site)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.remote.webdriver import WebDriver


@contextmanager
def chromium(*, window: tuple[int, int], page_load_timeout_s: float) -> Iterator[WebDriver]:
    """Headless Chromium through Debian's chromedriver (tests/services.sh installs both)."""
    binary, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    assert binary and chromedriver, "chromium and chromium-driver are not installed: run tests/services.sh"
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(argument)
    options.add_argument(f"--window-size={window[0]},{window[1]}")
    driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)
    driver.set_page_load_timeout(page_load_timeout_s)
    try:
        yield driver
    finally:
        driver.quit()
