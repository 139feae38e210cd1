"""`examples/blackjack_grpo.py`, Blackjack on `plies.rl.train`, runs end to end on the smoke budget
and resumes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plies import Group
from plies.rl import RunLog
from plies.runtime import read_jsonl

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "blackjack_grpo.py"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def example(out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), "--out", str(out), "--budget", "smoke"],
        capture_output=True, text=True, env=ENV, timeout=900,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(2 * 900 + 60)  # the subprocess deadlines bound it; the default 300 s cannot
def test_example_warm_starts_trains_and_evaluates(tmp_path):
    out = tmp_path / "run"
    done = example(out)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    log = RunLog(out / "grpo" / "metrics.jsonl")
    steps = log.all("step")
    log.close()
    assert [r["step"] for r in steps] == [0, 1, 2]  # the smoke budget's three steps
    assert summary["policy"] == steps[-1]["policy"]["version"]
    loop = json.loads((out / "grpo" / "summary.json").read_text())  # plies.rl's own
    assert loop["grpo_steps"] == 3 and loop["complete"] and not loop["stopped_early"]
    assert loop["policy"] == steps[-1]["policy"]
    assert math.isfinite(summary["warm_start_return"]), summary
    assert math.isfinite(summary["final_return"]), summary
    assert "warm start: return" in done.stdout and "after GRPO: return" in done.stdout
    groups = read_jsonl(out / "grpo" / "groups.jsonl", Group)
    # keep_policies=1: the base, the warm start (GRPO's start, which sampled the first groups)
    # and the newest stay; the rest are gone from the server's store, and recorded as such.
    warm = min(t.turns[0].policy.version for g in groups.records for t in g.trajectories)
    kept = [0, warm, steps[-1]["policy"]["version"]]
    retention = json.loads((out / "grpo" / "retention.json").read_text())
    removed = list(range(warm + 1, kept[2]))
    assert retention == {"keep_policies": 1, "kept": kept, "removed": removed}
    store = out / "server" / "policies"
    assert sorted(int(p.name) for p in store.iterdir() if p.name.isdigit()) == kept
    assert groups.clean and groups.records
    assert all(len(g.trajectories) == 4 for g in groups.records)  # the smoke group size

    again = example(out)  # the same command resumes: the steps are not taken again
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "resuming the run in" in again.stderr
    resumed = RunLog(out / "grpo" / "metrics.jsonl")
    assert resumed.all("step") == steps
    resumed.close()
    assert json.loads((out / "summary.json").read_text())["policy"] == summary["policy"]
