"""What the demo tests read back from a run: its metrics records, and a bounded wait."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest


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
