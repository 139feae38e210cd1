"""The gateway example trains end to end: its groups pass `training_groups` and it publishes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parents[2] / "examples" / "gateway_agent.py"


def test_gateway_example_trains_a_few_steps():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, str(EXAMPLE), "train", "--steps", "2", "--tasks", "2"]
    proc = subprocess.run(
        [*argv, "--group-size", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = re.findall(r"step (\d+): (\d+)/(\d+) groups trainable", proc.stdout)
    assert [s[0] for s in steps] == ["0", "1"], proc.stdout
    assert all(trainable == total == "2" for _, trainable, total in steps), proc.stdout
    published = [int(v) for v in re.findall(r"published policy version (\d+)", proc.stdout)]
    assert published == [1, 2], proc.stdout
