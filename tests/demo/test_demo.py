"""`plies demo blackjack` end to end as a subprocess: a short run, and Ctrl-C then resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from demo_runs import records, wait

from plies.runtime import read_groups
from plies.testing import plies_command

DEMO = plies_command("demo", "blackjack")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def demo(out: Path, *args: str) -> subprocess.Popen:
    log = (out.parent / f"{out.name}.log").open("ab")
    return subprocess.Popen(
        [*DEMO, "--out", str(out), "--budget", "smoke", *args],
        stdout=log, stderr=subprocess.STDOUT, env=ENV,
    )  # fmt: skip


@pytest.mark.slow
def test_short_demo_writes_metrics_summary_and_curve(tmp_path):
    out = tmp_path / "run"
    rc = wait(demo(out), out, 900)
    log = (tmp_path / "run.log").read_text(errors="replace")
    assert rc == 0, log[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for key in ("warm_start_return", "final_return", "eval_hands", "minutes", "policies"):
        assert summary[key] is not None, key
    assert summary["complete"] and summary["grpo_steps"] == 3
    evals = {r["label"]: r for r in records(out, "eval")}
    assert summary["eval_hands"] + evals["final"]["failed"] == 32
    assert evals["warm_start"]["policy"] == 1 and evals["warm_start"]["hands"] == 32
    assert evals["final"]["return"] == summary["final_return"]
    steps = records(out, "step")
    assert [s["step"] for s in steps] == [0, 1, 2]
    published = {s["policy"]["version"] for s in steps} | {1}
    assert summary["policies"] == len(published)
    for figure in ("learning_curve.png", "strategy.png"):
        assert (out / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", figure
    # The paired comparison: both evaluations played the same 32 deals, hand by hand.
    low, high = summary["final_ci95"]
    assert low <= summary["final_return"] <= high
    pairs = [
        (a, b)
        for a, b in zip(evals["warm_start"]["rewards"], evals["final"]["rewards"], strict=True)
        if a is not None and b is not None
    ]
    assert summary["paired_hands"] == len(pairs) >= 30
    mean = sum(b - a for a, b in pairs) / len(pairs)
    assert summary["improvement"] == pytest.approx(mean, abs=1e-4)
    low, high = summary["improvement_ci95"]
    assert low <= summary["improvement"] <= high
    # The strategy grid counts exactly the final evaluation's decisions.
    cells = [c for kind in ("hard", "soft") for row in summary["strategy"][kind].values()
             for c in row.values()]  # fmt: skip
    assert sum(c["decisions"] for c in cells) == len(evals["final"]["decisions"]) > 0
    groups = read_groups(out / "groups.jsonl")
    assert groups.clean
    trained = {g for s in steps for g in s["groups"]}
    assert trained <= {g.id for g in groups.records}


@pytest.mark.slow
def test_ctrl_c_then_resume_continues_from_the_last_published_policy(tmp_path):
    out = tmp_path / "run"
    proc = demo(out)
    deadline = time.monotonic() + 900
    while not records(out, "step") and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert proc.poll() is None, "the demo ended before its first GRPO step was published"
    proc.send_signal(signal.SIGINT)
    assert wait(proc, out, 300) == 130
    before = records(out, "step")
    assert before, "a step was published before the interrupt"
    last = before[-1]["policy"]
    trained = {g for s in before for g in s["groups"]}
    completed = [g.id for g in read_groups(out / "groups.jsonl").records]
    untrained = [g for g in completed if g not in trained]

    rc = wait(demo(out), out, 900)
    assert rc == 0, (tmp_path / "run.log").read_text(errors="replace")[-3000:]
    after = records(out, "step")
    assert [s["step"] for s in after] == list(range(len(after)))  # none repeated, none skipped
    resumed = after[len(before)]
    # Trained on top of `last` (a step whose groups all tied publishes nothing new).
    published = 1 if resumed.get("loss") is not None else 0
    assert resumed["policy"]["version"] == last["version"] + published
    if untrained:  # completed before the interrupt, trained first after it
        assert resumed["groups"] == untrained[: len(resumed["groups"])]
    for group in read_groups(out / "groups.jsonl").records:
        if group.id not in completed:
            assert group.policy.version >= last["version"]
    assert json.loads((out / "summary.json").read_text())["complete"]
