"""Harbor's own loader accepts the tasks plies ships, and reads them as plies does.

Harbor needs Python >= 3.12 and plies' environments are 3.11, so Harbor lives in its own
environment: `.ci/envs-tier` makes it and names its python in `PLIES_HARBOR_PYTHON`.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from plies.environments import HarborTask

HARBOR_PYTHON = os.environ.get("PLIES_HARBOR_PYTHON")
TASKS = sorted(p for p in (Path(__file__).parents[2] / "examples" / "harbor").iterdir())

SKIP = "PLIES_HARBOR_PYTHON is not set (run .ci/envs-tier)"
pytestmark = [pytest.mark.harbor, pytest.mark.skipif(not HARBOR_PYTHON, reason=SKIP)]

READ = """
import json, sys
from harbor.models.task.task import Task
out = {}
for path in sys.argv[1:]:
    assert Task.is_valid_dir(path), path
    t = Task(path)
    c = t.config
    out[path] = {
        "name": t.name, "instruction": t.instruction.strip(),
        "agent": c.agent.timeout_sec, "verifier": c.verifier.timeout_sec,
        "build": c.environment.build_timeout_sec, "workdir": c.environment.workdir,
        "solution": t.paths.solve_path.is_file(), "network": c.environment.network_mode.value,
    }
print(json.dumps(out))
"""


def test_harbor_accepts_every_shipped_task_and_reads_what_plies_reads():
    assert len(TASKS) >= 2
    argv = [str(HARBOR_PYTHON), "-W", "error::DeprecationWarning", "-c", READ]
    done = subprocess.run([*argv, *map(str, TASKS)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    harbor = json.loads(done.stdout)
    for path in TASKS:
        ours = HarborTask.load(path)
        theirs = harbor[str(path)]
        assert theirs["name"] == ours.name
        assert theirs["instruction"] == ours.instruction
        assert theirs["agent"] == ours.agent_timeout_s
        assert theirs["verifier"] == ours.verifier_timeout_s
        assert theirs["build"] == ours.build_timeout_s
        assert theirs["solution"] is ours.has_solution is True
        assert theirs["network"] == "no-network", "shipped tasks say they need no network"
