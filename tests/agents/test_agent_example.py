"""`examples/agent_cli_grpo.py` trains GRPO steps on episodes a real agent CLI played."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from agent_kit import require_agent

EXAMPLE = Path(__file__).parents[2] / "examples" / "agent_cli_grpo.py"


def test_the_example_trains_on_agent_episodes(tmp_path):
    require_agent("pi")
    out = tmp_path / "run"
    argv = [sys.executable, str(EXAMPLE), "--out", str(out), "--agent", "pi"]
    argv += ["--steps", "2", "--groups", "2", "--group-size", "2", "--seed", "0"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    steps = summary["steps"]
    assert [s["step"] for s in steps] == [0, 1]
    for step in steps:
        assert step["trainable_groups"] == 2 and step["refused"] == []
        assert set(step["rewards"]) <= {0.0, 1.0} and len(step["rewards"]) == 4
        assert step["turns"] == 4 * 3  # write, show, answer: every turn recorded
    # The seeded script writes the right file in some episodes and not in others, so at
    # least one step had a signal and made a new policy.
    trained = [s for s in steps if "loss" in s]
    assert trained and steps[-1]["policy_version"] == len(trained)
    lines = (out / "groups.jsonl").read_text().splitlines()
    assert len(lines) == 4 and all(json.loads(line)["size"] == 2 for line in lines)
    assert not list((out / "workspaces").iterdir())
