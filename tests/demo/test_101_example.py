"""`examples/101_custom_env.py`, the first env, trains with `plies.rl.train` and resumes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plies import Group
from plies.rl import RUN_SCHEMA, RunLog
from plies.runtime import read_jsonl
from plies.view import RunView

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "101_custom_env.py"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def example(cwd: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), str(out)], cwd=cwd, capture_output=True, text=True,
        env=ENV, timeout=600,
    )  # fmt: skip


@pytest.mark.timeout(2 * 600 + 300 + 60)  # the subprocess deadlines bound it, not the default 300 s
def test_the_first_env_trains_in_a_run_directory_that_the_same_command_resumes(tmp_path):
    cwd, out = tmp_path / "cwd", tmp_path / "run"
    cwd.mkdir()
    done = example(cwd, out)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    run = json.loads((out / "grpo" / "run.json").read_text())
    assert run["schema"] == RUN_SCHEMA and run["kind"] == "grpo"
    assert run["config"]["group_size"] == 4 and run["config"]["steps"] == 4
    groups = read_jsonl(out / "grpo" / "groups.jsonl", Group)
    assert groups.clean and groups.records
    assert all(len(g.trajectories) == 4 for g in groups.records)
    log = RunLog(out / "grpo" / "metrics.jsonl")
    # Every group the log trained or set aside is on disk (fsynced before it was judged);
    # groups that completed after the loop stopped are on disk too, untrained.
    kinds = ("step", "set_aside", "skipped")
    used = {g for kind in kinds for r in log.all(kind) for g in r["groups"]}
    assert used and used <= {g.id for g in groups.records}
    steps = log.all("step")
    if steps:  # the random model's members scored differently at least once
        assert f"policy version {steps[-1]['policy']['version']}" in done.stdout
    else:  # they all tied: set aside, and the loop stopped after two batches' worth
        assert {r["reason"] for r in log.all("set_aside")} <= {"tied", "truncated"}
        assert "GRPO stopped at step 0: 16 episodes in a row trained nothing" in done.stderr
    summary = json.loads((out / "grpo" / "summary.json").read_text())
    assert summary["grpo_steps"] == len(steps) and summary["complete"] is True
    assert summary["stopped_early"] is (len(steps) < 4)
    assert sum(summary["set_aside"].values()) == len(log.all("set_aside"))
    # The held-out tasks, played before and after GRPO, the same eight both times.
    # And after every second step but the last, for the learning curve (`eval_every=2`).
    evals = {(e["label"], e["step"]): e for e in log.all("eval")}
    curve = [("curve", step) for step in range(2, len(steps), 2)]
    assert sorted(evals) == sorted([("final", len(steps)), ("start", 0), *curve])
    for (label, _), record in evals.items():
        assert len(record["rewards"]) == 8 == record["episodes"] + record["failed"]
        if label != "curve":
            assert summary["held_out"][label]["episodes"] == record["episodes"]
    assert (out / "grpo" / "learning_curve.png").read_bytes().startswith(b"\x89PNG")
    assert summary["held_out"]["improvement"]["paired"] == evals["final", len(steps)]["episodes"]
    log.close()

    again = example(cwd, out)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert f"resuming the run in {out / 'grpo'}" in again.stderr
    assert read_jsonl(out / "grpo" / "groups.jsonl", Group).records == groups.records  # no new work
    assert list(cwd.iterdir()) == [], "the example writes only into its run directory"

    view = subprocess.run(
        [sys.executable, "-m", "plies", "view", str(out / "grpo")],
        capture_output=True, text=True, env=ENV, timeout=300,
    )  # fmt: skip
    assert view.returncode == 0, view.stderr[-2000:]
    assert (out / "grpo" / "view.html").stat().st_size > 0
    snapshot = RunView(out / "grpo")._reader.refresh()  # what the page was made from
    resumed = json.loads((out / "grpo" / "summary.json").read_text())  # rewritten by the resume
    assert snapshot.problems == [] and snapshot.summary == resumed
    assert resumed["grpo_steps"] == summary["grpo_steps"]
    assert resumed["minutes"] > summary["minutes"]  # both sessions
    assert resumed["held_out"] == summary["held_out"]  # read back, not played again
    assert len(snapshot.groups) == len(groups.records)
