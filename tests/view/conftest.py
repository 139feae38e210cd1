"""Headless Chromium. (The real demo run the tests read is `demo_run`, in tests/conftest.py.)

The browser tests need Debian's `chromium` and `chromium-driver`; `.ci/run` installs them
when missing, so they run in CI. Locally, without them, the tests skip and say so.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    """Headless Chromium through chromedriver (selenium)."""
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip(
            "Debian's chromium and chromium-driver are not installed "
            "(apt-get install -y chromium chromium-driver; .ci/run does it)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument("--window-size=1400,1000")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
