"""What the demo tests read back from a run: its metrics records, a bounded wait, and a
Ctrl-C that lands once the run has got as far as a test needs."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest


def records(out: Path, kind: str) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [r for r in lines if r["kind"] == kind]


def log_tail(out: Path) -> str:
    """The end of the demo's output (`RUN.log` beside the run directory), for a failure."""
    return (out.parent / f"{out.name}.log").read_text(errors="replace")[-3000:]


def wait(proc: subprocess.Popen, out: Path, timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the demo did not finish in {timeout}s:\n{log_tail(out)}")


def interrupt_when(
    proc: subprocess.Popen,
    out: Path,
    ready: Callable[[], bool],
    *,
    within: float,
    before: str,
    poll: float = 0.5,
) -> int:
    """Ctrl-C the demo writing `out` once `ready()` holds (or `within` seconds passed; the
    test's own checks then say what was missing), and its exit status. `poll`: how often
    `ready` is asked, short where the interrupt must land inside a brief phase.

    Fails, with the log's tail, when the demo ended `before` that.
    """
    deadline = time.monotonic() + within
    try:
        while not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(poll)
        assert proc.poll() is None, f"the demo ended before {before}:\n{log_tail(out)}"
    finally:
        if proc.poll() is None:  # also when `ready` raised: no demo outlives its test
            proc.send_signal(signal.SIGINT)
    return wait(proc, out, 300)
