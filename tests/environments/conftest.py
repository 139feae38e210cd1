"""Fixtures for environment tests: real servers started as subprocesses on 127.0.0.1."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from plies.testing import serve_process_sync


@contextmanager
def serve_blackjack(max_sessions: int, timeout_s: float = 90.0) -> Iterator[dict[str, Any]]:
    """Run `python -m plies.environments.openenv_server`; yield its ready line plus `process`."""
    argv = [sys.executable, "-m", "plies.environments.openenv_server", "--port", "0"]
    argv += ["--max-sessions", str(max_sessions)]
    env = {k: v for k, v in os.environ.items() if k != "ENABLE_WEB_INTERFACE"}
    with tempfile.TemporaryDirectory() as logs:
        log = Path(logs) / "openenv.log"
        with serve_process_sync(argv, log=log, env=env, ready_timeout=timeout_s) as server:
            yield {**server.ready, "process": server.process}


@pytest.fixture(scope="session")
def start_blackjack_server():
    """`serve_blackjack` itself, for tests that need a server of their own."""
    return serve_blackjack


@pytest.fixture(scope="module")
def blackjack_server() -> Iterator[dict[str, Any]]:
    """A Blackjack OpenEnv server that allows 2 concurrent sessions."""
    with serve_blackjack(max_sessions=2) as server:
        yield server


NPM_MCP_SERVERS = (
    "@modelcontextprotocol/server-memory@2026.8.31",
    "@modelcontextprotocol/server-everything@2026.8.31",
    "@modelcontextprotocol/server-filesystem@2026.8.31",
)
"""Third-party MCP servers from npm, pinned; installed once per machine into the plies cache."""


@pytest.fixture(scope="session")
def npm_bin() -> Path:
    """`node_modules/.bin` holding the pinned npm MCP servers (`npm install` on first use)."""
    import hashlib
    import shutil
    import subprocess

    from plies.testing._models import kit_dir

    digest = hashlib.sha256(" ".join(NPM_MCP_SERVERS).encode()).hexdigest()[:12]
    root = kit_dir().parent.parent / f"npm-mcp-{digest}"
    if not (root / "node_modules" / ".bin" / "mcp-server-filesystem").exists():
        npm = shutil.which("npm")
        assert npm is not None, "npm is needed for the MCP server tests (Debian's nodejs, npm)"
        root.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".npm-mcp-", dir=root.parent))
        subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--prefix", str(staging),
             *NPM_MCP_SERVERS],
            check=True, capture_output=True, timeout=600,
        )  # fmt: skip
        try:
            staging.rename(root)
        except OSError:  # another run published it first
            shutil.rmtree(staging, ignore_errors=True)
    return root / "node_modules" / ".bin"
