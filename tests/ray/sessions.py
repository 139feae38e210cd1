"""Processes by session, for the Ray tests that run scripts and clusters of their own.

A process started in a session of its own (`start_new_session=True`) leaves every process it
and its Ray start in that session, whatever their parent becomes, so the session id finds
what a run left behind (`session_processes`) and stops it (`end_sessions`). `Script` runs
`sharded_script.py` that way and collects its stdout events.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from event_script import EventScript

SCRIPT = Path(__file__).parent / "sharded_script.py"


def session_processes(sid: int) -> list[str]:
    """Live (not zombie) processes of session `sid`: what a run left behind."""
    out = subprocess.run(
        ["ps", "-eo", "pid=,sid=,stat=,args="], capture_output=True, text=True, check=True
    ).stdout
    left = []
    for line in out.splitlines():
        pid, s, stat, args = [*line.split(None, 3), ""][:4]
        if int(s) == sid and not stat.startswith("Z"):
            left.append(f"{pid} {args[:120]}")
    return left


def left_after(sid: int, timeout: float, title: str = "") -> list[str]:
    """The processes of session `sid` whose command line has `title` in it that are still
    there after up to `timeout` seconds (processes take a moment to go)."""
    deadline = time.monotonic() + timeout
    while True:
        left = [line for line in session_processes(sid) if title in line]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def end_sessions(sids: list[int], grace: float = 2.0) -> list[str]:
    """SIGTERM every process of these sessions, SIGKILL what is left after `grace` seconds
    (Ray's daemons take 10 s and more to go on SIGTERM); what is still there 15 s later
    (nothing, unless a process is stuck)."""
    left: list[str] = []
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 15.0)):
        for sid in sids:
            for line in session_processes(sid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(line.split()[0]), sig)
        deadline = time.monotonic() + wait
        left = [p for sid in sids for p in left_after(sid, deadline - time.monotonic())]
    return left


class Script(EventScript):
    """One run of `sharded_script.py` in a session of its own, its stdout events collected
    as they come (Ray's own lines in `noise`). `args` follow RUN_DIR POLICY_URL SEED (see
    the script)."""

    def __init__(self, run_dir: Path, policy_url: str, seed: int, *args: str):
        env = {**os.environ, "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}
        super().__init__(
            [sys.executable, str(SCRIPT), str(run_dir), policy_url, str(seed), *args],
            cwd=run_dir,
            env=env,
            start_new_session=True,
        )

    def kill(self) -> None:
        """Kill the whole session: the script and the Ray processes it started."""
        os.killpg(self.proc.pid, signal.SIGKILL)

    def ids(self, event: str) -> set[str]:
        return {e["id"] for e in self.all(event)}
