"""Ctrl-C during MCP and Harbor episodes: nothing leaks, records are whole.

`envs_signal_script.py` plays four episodes at once (MCP: a server-memory process each;
Harbor: a bubblewrap sandbox each, running a long command). After the signals: exit 130 with
no traceback, only whole records on disk, a complete quarantine report, and after `plies reap`
on it no server process and no sandbox left.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from event_script import EventScript

from plies import Group
from plies.environments.mcp_client import marked_processes
from plies.runtime import read_jsonl
from plies.runtime._report import read_report
from plies.testing import sandbox_processes

HERE = Path(__file__).parent
PLIES = str(Path(sys.executable).with_name("plies"))


def one_run(kind: str, run_dir: Path, npm_bin: Path, interrupts: int) -> None:
    run_dir.mkdir()
    argv = [sys.executable, str(HERE / "envs_signal_script.py"), kind, str(run_dir), str(npm_bin)]
    script = EventScript(argv)
    try:
        # Every episode has its env and is sampling.
        sampling = script.wait_for(
            lambda _: len({e["session"] for e in script.all("turn")}) >= 4, 150
        )
        assert sampling is not None, f"the script ended early: {script.events}\n{script.err}"
        time.sleep(0.5)  # the Harbor episodes are in their long command by now
        for _ in range(interrupts):
            script.proc.send_signal(signal.SIGINT)
            time.sleep(0.5)
        code, err = script.finish(timeout=90)
    finally:
        script.finish(timeout=0.1)
    context = f"{kind} x{interrupts}\n{err}"
    assert code == 130, context
    assert "Traceback" not in err and script.noise == [], context
    [stats] = script.all("stats")
    assert stats["live"] == 0, context
    assert stats["borrowed"] == stats["released"] + stats["quarantined"] == 4, context
    read = read_jsonl(run_dir / "groups.jsonl", Group)
    assert read.malformed == [], context
    assert all(g.complete for g in read.records), context
    report = read_report(run_dir / "quarantine.json")
    assert report.complete, context
    leases = [e for e in report.entries if e.stage == "lease"]
    assert len(leases) == stats["quarantined"], context
    if report.may_exist:
        reap = subprocess.run(
            [PLIES, "reap", str(run_dir / "quarantine.json")],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert reap.returncode == 0 and "failed" not in reap.stdout, reap.stdout + reap.stderr
    if kind == "harbor":
        assert sandbox_processes(run_dir / "sandboxes") == [], context
        assert list((run_dir / "sandboxes").iterdir()) == [], context


@pytest.mark.timeout(240)
@pytest.mark.xdist_group("mcp_processes")  # its leak check counts every MCP server: test_mcp_env
def test_ctrl_c_during_mcp_and_harbor_episodes_leaks_nothing(tmp_path, npm_bin):
    plans = [("mcp", 3), ("harbor", 2)]  # cancel, and abort; one run of each at once
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(one_run, kind, tmp_path / f"{kind}-{n}", npm_bin, n) for kind, n in plans
        ]
        for future in futures:
            future.result()
    assert marked_processes() == [], "no MCP server process is left"
