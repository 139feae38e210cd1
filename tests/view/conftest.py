"""A real demo run (the smoke budget), made once per session, and headless Chromium.

The browser tests need Debian's `chromium` and `chromium-driver`; `.ci/run` installs them
when missing, so they run in CI. Locally, without them, the tests skip and say so.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from _view_runs import DEMO_TIMEOUT, ENV

from plies.testing import plies_command

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")


REUSE_RUN = "PLIES_TEST_DEMO_RUN"
"""A finished smoke run directory (`plies demo blackjack --budget smoke --out DIR`) that the
session uses instead of making its own: for iterating on a loaded machine, where the demo
takes tens of minutes. Unset (as in CI), every session makes a fresh run. Tests only read it;
those that alter a run alter a copy."""


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> Iterator[Path]:
    """`plies demo blackjack --budget smoke`, run once for every test of the session.

    Stopped with Ctrl-C (SIGINT) on every path, so the demo stops its own server.
    """
    if reuse := os.environ.get(REUSE_RUN):
        summary = Path(reuse) / "summary.json"
        assert summary.is_file(), f"{REUSE_RUN}={reuse}: no finished run there ({summary})"
        yield Path(reuse)
        return
    out = tmp_path_factory.mktemp("view-demo") / "run"
    log = out.parent / "demo.log"
    argv = [*plies_command("demo", "blackjack"), "--out", str(out), "--budget", "smoke"]
    with log.open("wb") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=ENV)
        try:
            rc = proc.wait(DEMO_TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    assert rc == 0, log.read_text(errors="replace")[-3000:]
    yield out


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
