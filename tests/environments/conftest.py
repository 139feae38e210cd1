"""Fixtures for environment tests: real servers started as subprocesses on 127.0.0.1."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest


@contextmanager
def serve_blackjack(max_sessions: int, timeout_s: float = 90.0) -> Iterator[dict[str, Any]]:
    """Run `python -m plies.environments.openenv_server`; yield its ready line plus `process`."""
    env = {k: v for k, v in os.environ.items() if k != "ENABLE_WEB_INTERFACE"}
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "plies.environments.openenv_server", "--port", "0",
             "--max-sessions", str(max_sessions)],
            stdout=subprocess.PIPE, stderr=stderr, env=env, text=True,
        )  # fmt: skip
        try:
            sel = selectors.DefaultSelector()
            sel.register(proc.stdout, selectors.EVENT_READ)
            deadline = time.monotonic() + timeout_s
            line = ""
            while not line and time.monotonic() < deadline and proc.poll() is None:
                if sel.select(timeout=0.2):
                    line = proc.stdout.readline()
            if not line:
                stderr.seek(0)
                raise RuntimeError(f"server did not start: {stderr.read().decode()[-2000:]}")
            yield {**json.loads(line), "process": proc}
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            proc.stdout.close()


@pytest.fixture(scope="session")
def start_blackjack_server():
    """`serve_blackjack` itself, for tests that need a server of their own."""
    return serve_blackjack


@pytest.fixture(scope="module")
def blackjack_server() -> Iterator[dict[str, Any]]:
    """A Blackjack OpenEnv server that allows 2 concurrent sessions."""
    with serve_blackjack(max_sessions=2) as server:
        yield server
