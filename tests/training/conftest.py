"""A real reference server as a subprocess on 127.0.0.1, restartable on the same port."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from plies.server._config import ServerConfig
from plies.server._trainer import TrainerConfig

# `serve` is what `plies serve` runs; a config object is the only way to reach the test-only
# trainer knobs, so the subprocess takes the whole config as JSON.
SERVE = (
    "import sys; from plies.server._serve import serve; "
    "from plies.server._config import ServerConfig; "
    "sys.exit(serve(ServerConfig.model_validate_json(sys.argv[1]), threads=1))"
)


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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def start_server(tmp_path, tiny_model_dir):
    """`start_server(state_dir, port=..., trainer=TrainerConfig(...)) -> Server`."""
    started: list[Server] = []

    def start(state_dir: Path, *, port: int = 0, trainer: TrainerConfig | None = None) -> Server:
        config = ServerConfig(
            model_dir=tiny_model_dir,
            state_dir=state_dir,
            port=port,
            device="cpu",
            trainer=trainer or TrainerConfig(),
        )
        log = tmp_path / f"server-{len(started)}.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        with log.open("w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-c", SERVE, config.model_dump_json()],
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                text=True,
            )
        deadline = time.monotonic() + 120
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], 0.5)
            if ready:
                line = proc.stdout.readline()
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"server did not start:\n{log.read_text()[-3000:]}")
        url = json.loads(line)["url"]
        server = Server(proc, url, int(url.rsplit(":", 1)[1]), log)
        started.append(server)
        return server

    yield start
    for server in started:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(timeout=30)
