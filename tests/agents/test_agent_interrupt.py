"""Ctrl-C during agent episodes leaves no process behind.

Each run (`interrupt_script.py`) plays two episodes of every installed agent CLI at once, each
agent's first tool call a long `sleep` in its workspace. Once every agent is inside that
sleep, the run gets SIGINT
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
from agent_kit import AGENTS, agent_installed

from plies.runtime import read_report

HERE = Path(__file__).parent
PLANS = [2, 3]
"""SIGINTs per run: twice (drain, then cancel) or three times (abort)."""


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


def _describe(pid: int) -> str:
    """A process's command line and whether it carries a sandbox id, for failure messages."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "gone"
    tagged = any(v.startswith(b"PLIES_SANDBOX_ID=") for v in _environ(pid))
    return f"{argv[:200]} (sandbox id: {tagged})"


def _sandbox_of(pid: int) -> str:
    for value in _environ(pid):
        if value.startswith(b"PLIES_SANDBOX_ID="):
            return value.split(b"=", 1)[1].decode()
    return ""


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
    """How many of the run's sandboxes (one an episode) have their agent inside a `sleep 300`."""
    sandboxes = set()
    for pid in _in_sandboxes(root):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[:2] == [b"sleep", b"300"]:
            sandboxes.add(_sandbox_of(pid))
    return len(sandboxes)


@pytest.mark.parametrize("signals", PLANS, ids=lambda n: f"sigint-x{n}")
def test_ctrl_c_during_agent_episodes_leaves_no_process(signals, qwen3_tokenizer, tmp_path):
    agents = [agent for agent in AGENTS if agent_installed(agent)]
    if not agents:
        pytest.skip("no agent is installed (run .ci/agents-tier)")
    sandboxes = tmp_path / "sandboxes"
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "interrupt_script.py"), str(tmp_path), *agents],
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
        while _sleeping(sandboxes) < 2 * len(agents):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            if time.monotonic() > deadline:
                running: dict[str, list[str]] = {}
                for pid in _in_sandboxes(sandboxes):
                    running.setdefault(Path(_sandbox_of(pid)).name, []).append(_describe(pid))
                pytest.fail(
                    f"{_sleeping(sandboxes)} of {2 * len(agents)} agents reached their sleep in "
                    f"120 s; running, by sandbox: {running}; "
                    f"sandboxes: {sorted(p.name for p in sandboxes.iterdir())}"
                )
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
    groups = tmp_path / "groups.jsonl"
    if groups.exists():
        for line in groups.read_text().splitlines():
            json.loads(line)
    # What is still there is exactly what the quarantine report says may exist (an abort
    # skips teardown; processes that left the agent's process group live on with their
    # sandbox); `plies reap` on the report ends it.
    time.sleep(0.5)  # a SIGKILLed process is reaped by init a moment later
    report_path = tmp_path / "quarantine.json"
    named: set[str] = set()
    if report_path.exists():
        named = {e.remote_id for e in read_report(report_path).may_exist if e.remote_id}
    running = {_sandbox_of(pid) for pid in _in_sandboxes(sandboxes)}
    left = {str(p) for p in sandboxes.iterdir()} if sandboxes.exists() else set()
    assert running <= named and left <= named, (running, left, named, err[-2000:])
    if named:
        reap = subprocess.run(
            [str(Path(sys.executable).with_name("plies")), "reap", str(report_path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert reap.returncode == 0, reap.stdout + reap.stderr
        time.sleep(0.5)
    survivors = {pid: _describe(pid) for pid in seen if _alive(pid)}
    assert not survivors, (survivors, err[-2000:])
    assert not _in_sandboxes(sandboxes)
    assert not sandboxes.exists() or not list(sandboxes.iterdir())
