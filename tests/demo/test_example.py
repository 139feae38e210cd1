"""`examples/blackjack_grpo.py`, the cookbook's GRPO loop, runs end to end on the smoke budget."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plies.runtime import read_groups

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "blackjack_grpo.py"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def example(out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), "--out", str(out), "--budget", "smoke"],
        capture_output=True, text=True, env=ENV, timeout=900,
    )  # fmt: skip


@pytest.mark.slow
def test_example_warm_starts_trains_and_evaluates(tmp_path):
    out = tmp_path / "run"
    done = example(out)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["grpo_steps"] == 3
    assert math.isfinite(summary["warm_start_return"]), summary
    assert math.isfinite(summary["final_return"]), summary
    assert "warm start: return" in done.stdout and "after GRPO: return" in done.stdout
    groups = read_groups(out / "groups.jsonl")
    assert groups.clean and groups.records
    assert all(len(g.trajectories) == 4 for g in groups.records)  # the smoke group size

    again = example(out)  # it does not resume: an earlier run's directory is refused
    assert again.returncode == 2 and "choose a new --out" in again.stderr
