"""The public surface of `plies.environments`, and what importing it costs."""

from __future__ import annotations

import pickle
import subprocess
import sys

import plies.environments as envs


def test_all_is_sorted_and_complete():
    assert envs.__all__ == sorted(envs.__all__)
    for name in envs.__all__:
        assert hasattr(envs, name), name
    assert envs.Task.__module__ == "plies.environments"
    task = envs.Task(id="t", seed=1, data={"k": [1]})
    assert pickle.loads(pickle.dumps(task)) == task


def test_importing_does_not_load_openenv_or_e2b():
    code = (
        "import sys, plies.environments\n"
        "print(sorted(m for m in ('openenv', 'e2b', 'gradio', 'mcp') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
