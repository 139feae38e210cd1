"""Ctrl-C during agent episodes leaves no process behind.

Each run (`interrupt_script.py`) plays two episodes of a real agent CLI whose first tool call
is a long `sleep` in its workspace. Once every agent is inside that sleep, the run gets SIGINT
twice (drain, then cancel) or three times (abort). Then: exit code 130 and no traceback; no
process of the run is left (neither the ones seen before the signals, nor any process that
carries one of its sandbox ids, which every agent's children inherit); no workspace is left
unless the quarantine report names it; the groups file holds only whole lines.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import AGENTS, require_agent, require_wire

from plies.gateway import Gateway
from plies.runtime import read_report
from plies.tokens import ChatRenderer

HERE = Path(__file__).parent
PLANS = {agent: 2 + k % 2 for k, agent in enumerate(AGENTS)}
"""SIGINTs per run, by agent: twice (drain, then cancel) or three times (abort)."""


def _environ(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _descendants(root: int) -> set[int]:
    """Every live process under `root` (by parent pid)."""
    parents: dict[int, int] = {}
    for pid in _pids():
        try:
            parents[pid] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def _in_sandboxes(root: Path) -> set[int]:
    """Live processes that carry a sandbox id under `root` (agents and all they started)."""
    prefix = f"PLIES_SANDBOX_ID={root}".encode()
    return {
        pid
        for pid in _pids()
        if pid != os.getpid() and _alive(pid) and any(v.startswith(prefix) for v in _environ(pid))
    }


def _sleeping(root: Path) -> int:
    """How many of the run's agents are inside their `sleep 300` tool call."""
    count = 0
    for pid in _in_sandboxes(root):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[:2] == [b"sleep", b"300"]:
            count += 1
    return count


@pytest.mark.parametrize("agent", list(AGENTS))
def test_ctrl_c_during_agent_episodes_leaves_no_process(agent, qwen3_tokenizer, tmp_path):
    adapter = require_agent(agent)
    require_wire(Gateway(None, ChatRenderer(qwen3_tokenizer)), adapter.wire)
    signals = PLANS[agent]
    sandboxes = tmp_path / "sandboxes"
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "interrupt_script.py"), str(tmp_path), agent],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        if not ready.strip():
            _, err = proc.communicate(timeout=30)
            pytest.fail(f"the run did not start: {err[-2000:]}")
        assert json.loads(ready) == {"event": "ready"}
        deadline = time.monotonic() + 120
        while _sleeping(sandboxes) < 2:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the agents never reached their sleep"
            time.sleep(0.2)
        seen = _descendants(proc.pid)
        assert seen, "the run has no child processes to leave behind"
        for _ in range(signals):
            os.kill(proc.pid, signal.SIGINT)
            time.sleep(0.5)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    time.sleep(0.5)  # a SIGKILLed process is reaped by init a moment later
    assert not [pid for pid in seen if _alive(pid)], err[-2000:]
    assert not _in_sandboxes(sandboxes)
    left = sorted(p for p in sandboxes.iterdir()) if sandboxes.exists() else []
    if left:  # a workspace that outlived the run must be on the report, by its id
        report = read_report(tmp_path / "quarantine.json")
        named = {record.remote_id for record in report.entries}
        named |= {ref.id for record in report.entries for ref in record.also_held}
        assert {str(p) for p in left} <= named
    groups = tmp_path / "groups.jsonl"
    if groups.exists():
        for line in groups.read_text().splitlines():
            json.loads(line)
