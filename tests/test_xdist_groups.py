"""The README's test command shares its slow session fixtures by `--dist loadgroup`
(`SHARED_ON_ONE_WORKER` in tests/conftest.py): every test of a group must run on one worker,
or each worker builds the fixture again. pytest 9.2 gives test nodes structured ids, and
pytest-xdist 3.8.0 still marks a test's group by rewriting the old id field, so there the
groups are split without a word (pytest-dev/pytest-xdist#1386): the smoke run and the warm
server were each built twice. This runs a small suite the way the README runs the real one."""

from __future__ import annotations

import os
import subprocess
import sys

GROUPED = """
import os
import pytest

@pytest.mark.xdist_group("shared")
@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    with open(os.environ["WORKERS_FILE"], "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")

@pytest.mark.parametrize("i", range(6))
def test_free(i):
    pass
"""


def test_a_group_runs_on_one_worker_under_the_readmes_distribution(tmp_path):
    for name in ("test_a.py", "test_b.py"):
        (tmp_path / name).write_text(GROUPED)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the repo's settings
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q",
         "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "base"), str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env={**os.environ, "WORKERS_FILE": str(tmp_path / "workers")},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    workers = (tmp_path / "workers").read_text().split()
    assert len(workers) == 12 and len(set(workers)) == 1, workers
