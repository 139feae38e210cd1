"""`plies reap` signals only process groups that carry the marks the runtime recorded: the
pid@start-time form, a group the pid still leads, never the reaper's own group."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plies import ConfigError
from plies.runtime import QuarantineReport, process_remote_id
from plies.runtime._reap import reap_process
from plies.runtime._report import QuarantineRecord, read_report
from plies.testing import plies_command, process_alive

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


@pytest.fixture
def leader():
    """A sleeping process that leads its own group, as the runtime starts them."""
    proc = subprocess.Popen(SLEEPER, start_new_session=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


@pytest.fixture
def follower():
    """A sleeping process in the test's own group: not one the runtime would record."""
    proc = subprocess.Popen(SLEEPER)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def report_of(path: Path, *remote_ids: str) -> Path:
    entries = [
        QuarantineRecord(lease_id=f"l{i}", pool="p", kind="process", remote_id=rid, reason="t")
        for i, rid in enumerate(remote_ids)
    ]
    path.write_text(QuarantineReport(run_id="r", complete=True, entries=entries).model_dump_json())
    return path


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("process", "mark", "refusal"),
    [
        ("leader", str, "is not 'pid@starttime'"),
        ("follower", process_remote_id, "no longer leads its process group"),
    ],
    ids=["a bare pid", "a pid that does not lead its group"],
)
async def test_a_refused_mark_leaves_its_process_alone(request, process, mark, refusal):
    proc = request.getfixturevalue(process)
    with pytest.raises(ConfigError, match=refusal):
        await reap_process(mark(proc.pid))
    assert process_alive(proc.pid)


@pytest.mark.anyio
async def test_the_reapers_own_group_is_never_signalled():
    # Refused before any mark is read: the group's leader may have exited long ago (pytest run
    # from a shell that is gone), and a stale start time must not make the group fair game.
    for pid in (os.getpid(), os.getpgrp()):
        with pytest.raises(ConfigError, match="refusing to signal process group"):
            await reap_process(f"{pid}@1")
    with pytest.raises(ConfigError, match="refusing to signal process group"):
        await reap_process(process_remote_id(os.getpid()))  # its true mark changes nothing


@pytest.mark.anyio
async def test_a_recycled_pid_is_gone_not_killed(leader):
    pid = leader.pid
    start = process_remote_id(pid).split("@")[1]
    assert await reap_process(f"{pid}@{int(start) + 1}") is False
    assert process_alive(pid)
    assert await reap_process(f"{pid}@{start}") is True
    leader.wait(timeout=10)
    assert not process_alive(pid)


def test_plies_reap_kills_only_what_carries_the_marks(tmp_path, leader, follower):
    report = report_of(
        tmp_path / "quarantine.json",
        process_remote_id(leader.pid),
        str(follower.pid),  # a bare pid, as an edited or foreign report would hold
        process_remote_id(follower.pid),  # right form, but not a group leader
    )
    done = subprocess.run(
        plies_command("reap", str(report)), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1, done.stdout + done.stderr  # two may still exist
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"killed   process {leader.pid}@"), done.stdout
    assert lines[1].startswith(f"failed   process {follower.pid} "), done.stdout
    assert "is not 'pid@starttime'" in lines[1]
    assert lines[2].startswith("failed") and "no longer leads" in lines[2], done.stdout
    leader.wait(timeout=10)
    time.sleep(0.2)
    assert process_alive(follower.pid)
    marks = [e.torn_down for e in read_report(report).entries]
    assert marks == [True, False, False]
