"""A real reference server as a subprocess on 127.0.0.1, restartable on the same port.

Servers run with `--test-faults`, so a test can hold the trainer at a fault point
(`POST /plies/test/hold`) and kill the server there.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from plies.testing import free_port, plies_command, serve_process_sync


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    port: int
    log: Path

    def kill(self) -> None:
        """SIGKILL: no shutdown hook runs, as in a crash."""
        self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def port() -> int:
    """A free loopback port, so a restarted server comes back at the same URL."""
    return free_port()


@pytest.fixture
def start_server(tmp_path, tiny_model_dir):
    """`start_server(state_dir, port=...) -> Server`."""
    started: list[Server] = []

    def start(state_dir: Path, *, port: int = 0) -> Server:
        log = tmp_path / f"server-{len(started)}.log"
        argv = plies_command(
            "serve", str(tiny_model_dir), "--state-dir", str(state_dir), "--port", str(port)
        )
        argv += ["--device", "cpu", "--threads", "1", "--test-faults"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        running = servers.enter_context(
            serve_process_sync(argv, log=log, env=env, ready_timeout=120)
        )
        server = Server(running.process, running.url, int(running.url.rsplit(":", 1)[1]), log)
        started.append(server)
        return server

    with contextlib.ExitStack() as servers:
        yield start
