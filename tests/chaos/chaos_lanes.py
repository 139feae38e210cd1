"""A lane: one `plies serve` that a sequence of trials shares, killed and restarted by some.

Trials on one lane run one after another, so the trainer behind the server sees one loop at
a time; lanes run side by side. The server keeps its port and state directory across a
kill -9 and restart, as a supervisor would bring it back, so the loop's clients reconnect to
the same URL and the trainer reopens its journal and last checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import httpx

from plies import testing

READY_TIMEOUT_S = 240.0


class Lane:
    """One restartable reference server (trainer and sampler in one process)."""

    def __init__(self, name: str, model_dir: Path, root: Path):
        self.name = name
        self.root = root
        self.state_dir = root / "state"
        port = testing.free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.argv = testing.plies_command(
            "serve", str(model_dir), "--state-dir", str(self.state_dir), "--port", str(port),
            "--threads", "1", "--max-batch-size", "32", "--test-faults",
        )  # fmt: skip
        self.pids: list[int] = []
        """Every server process this lane started, for the leak check."""
        self.ready: dict[str, Any] = {}
        self._stack = contextlib.ExitStack()
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = self.root / f"serve-{len(self.pids) + 1}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        server = self._stack.enter_context(
            testing.serve_process_sync(self.argv, log=log, env=env, ready_timeout=READY_TIMEOUT_S)
        )
        if server.url != self.url:
            raise AssertionError(f"{self.name}: server came up at {server.url}, not {self.url}")
        self._proc = server.process
        self.pids.append(server.pid)
        self.ready = server.ready

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def kill(self) -> None:
        """kill -9: no shutdown hook, no flush; what is on disk is what survives."""
        assert self._proc is not None
        self._proc.kill()
        self._proc.wait(timeout=30)

    def close(self) -> None:
        self._stack.close()

    # what the server says about itself ---------------------------------------------------

    def get(self, path: str) -> Any:
        return httpx.get(self.url + path, timeout=30).raise_for_status().json()

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return httpx.post(self.url + path, json=body, timeout=30).raise_for_status().json()

    def latest_policy(self) -> dict[str, Any]:
        return max(self.get("/plies/policies")["published"], key=lambda p: p["version"])

    def trainer_state(self) -> dict[str, Any]:
        return self.get("/v1/training/state")

    def journal(self) -> list[dict[str, Any]]:
        """The trainer's journal of applied ops (whole lines only: a torn tail never applied)."""
        path = self.state_dir / "trainer" / "journal.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines(keepends=True)
        return [json.loads(line) for line in lines if line.endswith("\n")]
