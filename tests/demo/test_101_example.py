"""`examples/101_custom_env.py`, the first env, runs as is: its default group trains one step."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "101_custom_env.py"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
MEMBER = re.compile(r"^(completed|truncated) \((\w+)\), reward (-?\d+\.\d+): ", re.M)


def test_the_first_env_plays_a_group_and_trains_one_step(tmp_path):
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)], cwd=tmp_path, capture_output=True, text=True,
        env=ENV, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    members = MEMBER.findall(done.stdout)
    assert len(members) == 4, done.stdout  # one group of four, every member scored
    assert all(
        reason in ("done", "ill_formed") or reason.startswith("max_") for _, reason, _ in members
    )
    assert "trainable 1, refused 0" in done.stdout, done.stdout
    assert "trained one step: policy version 1" in done.stdout, done.stdout
    assert list(tmp_path.iterdir()) == [], "the example leaves nothing in the working directory"
