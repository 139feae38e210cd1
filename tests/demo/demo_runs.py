"""What the demo tests read back from a run: its metrics records, and a bounded wait; and the
cheaper warm start the Ctrl-C tests run with."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

WARM = {"warm_steps": 60, "warm_batch": 4}
"""A cheaper warm start than the smoke budget's 100 steps of 8, for the tests of Ctrl-C and
resume, which test the run's bookkeeping, not the warm start (on the Tinker API, where each
forward_backward runs the output layer over whole sequences, the smoke one took 747 s of a
CI run). Short enough to matter, long enough that GRPO still has groups that differ: with 25
steps of 8 every answer was ill-formed, no group differed and no GRPO step ran."""
WARM_ARGS = tuple(arg for field, value in WARM.items() for arg in ("--set", f"{field}={value}"))
"""`WARM` as `plies demo blackjack` options."""


def records(out: Path, kind: str) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [r for r in lines if r["kind"] == kind]


def wait(proc: subprocess.Popen, out: Path, timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        log = (out.parent / f"{out.name}.log").read_text(errors="replace")[-3000:]
        pytest.fail(f"the demo did not finish in {timeout}s:\n{log}")
