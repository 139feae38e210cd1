"""Ctrl-C during agent episodes leaves no process behind.

Each run (`interrupt_script.py`) plays two episodes of every installed agent CLI at once, each
agent's first tool call a long `sleep` in its workspace; two more runs do the same with Codex
and Claude Code inside Harbor tasks' bubblewrap sandboxes, and playing an env served to them
over MCP. Once every agent is inside that sleep, the run gets SIGINT twice (drain, then
cancel) or three times (abort). Then: exit code 130 and no traceback; no process of the run
is left (neither the ones seen before the signals, nor any process that carries one of its
sandbox ids, which every agent's children inherit); no workspace is left unless the
quarantine report names it; the groups file holds only whole lines.

The chaos test does the same at random moments (20 trials by default: a random world, one or
two agents, a moment from the run's start into the agents' sleeps, two or three SIGINTs).
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from agent_kit import AGENTS, agent_installed

from plies.runtime._report import read_report
from plies.testing import process_alive

HERE = Path(__file__).parent
PLANS = [(2, "workspace"), (3, "workspace"), (2, "harbor"), (3, "mcp")]
"""SIGINTs per run (twice: drain, then cancel; three times: abort), and the env played."""
CHAOS_TRIALS = int(os.environ.get("PLIES_AGENT_CHAOS_TRIALS") or 20)
CHAOS_LANES = 2
MCP_AGENTS = ("claude-code", "codex")
"""The agents that run in a Harbor sandbox (their installation shared) and speak MCP."""


def _environ(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


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
        if pid != os.getpid()
        and process_alive(pid)
        and any(v.startswith(prefix) for v in _environ(pid))
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


@pytest.mark.parametrize(("signals", "world"), PLANS, ids=[f"{w}-sigint-x{n}" for n, w in PLANS])
def test_ctrl_c_during_agent_episodes_leaves_no_process(signals, world, tmp_path):
    agents = _agents(world)
    if not agents:
        pytest.skip("no agent is installed (run .ci/agents-tier)")
    interrupt_and_check(tmp_path, world, agents, signals)


@pytest.mark.timeout(60 * CHAOS_TRIALS)
def test_ctrl_c_at_random_moments_of_agent_episodes(tmp_path):
    """Chaos: trials of a random world, agents, moment (from the run's start to well into
    the agents' sleeps) and number of SIGINTs; the same checks after each. The seed is
    printed, and `PLIES_AGENT_CHAOS_SEED` replays it."""
    if not _agents("workspace"):
        pytest.skip("no agent is installed (run .ci/agents-tier)")
    seed = int(os.environ.get("PLIES_AGENT_CHAOS_SEED") or secrets.randbelow(10**6))
    rng = random.Random(seed)
    print(f"agent chaos seed {seed}: PLIES_AGENT_CHAOS_SEED={seed} replays it")
    trials = []
    for trial in range(CHAOS_TRIALS):
        world = rng.choice(["workspace", "harbor", "mcp"])
        installed = _agents(world)
        agents = rng.sample(installed, k=min(len(installed), rng.choice([1, 2])))
        trials.append((trial, world, agents, rng.uniform(0.0, 8.0), rng.choice([2, 3])))

    def one(trial: int, world: str, agents: list[str], moment: float, signals: int) -> None:
        what = f"trial {trial} of seed {seed}: {world}, {agents}, {moment:.1f} s, x{signals}"
        try:
            interrupt_and_check(tmp_path / f"t{trial}", world, agents, signals, moment)
        except BaseException as exc:  # pytest.fail's Failed is not an Exception
            raise AssertionError(f"{what}: {exc}") from exc

    # Two runs at a time: a trial mostly waits on agents starting and on its signals.
    with ThreadPoolExecutor(max_workers=CHAOS_LANES) as lanes:
        for done in [lanes.submit(one, *t) for t in trials if t[2]]:
            done.result()


def _agents(world: str) -> list[str]:
    return [a for a in AGENTS if agent_installed(a) and (world == "workspace" or a in MCP_AGENTS)]


def interrupt_and_check(
    run_dir: Path, world: str, agents: list[str], signals: int, moment: float | None = None
) -> None:
    """Run the interrupt script, send `signals` SIGINTs, and check what is left.

    `moment`: seconds after the run is ready; None waits until every agent is in its sleep.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    sandboxes = run_dir / "sandboxes"
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "interrupt_script.py"), str(run_dir), world, *agents],
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
        if moment is not None:
            time.sleep(moment)
        else:
            _wait_for_sleeps(proc, sandboxes, 2 * len(agents))
        seen = _descendants(proc.pid)
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
    groups = run_dir / "groups.jsonl"
    if groups.exists():
        for line in groups.read_text().splitlines():
            json.loads(line)
    # What is still there is exactly what the quarantine report says may exist (an abort
    # skips teardown; processes that left the agent's process group live on with their
    # sandbox); `plies reap` on the report ends it.
    time.sleep(0.5)  # a SIGKILLed process is reaped by init a moment later
    report_path = run_dir / "quarantine.json"
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
    survivors = {pid: _describe(pid) for pid in seen if process_alive(pid)}
    assert not survivors, (survivors, err[-2000:])
    assert not _in_sandboxes(sandboxes)
    assert not sandboxes.exists() or not list(sandboxes.iterdir())


def _wait_for_sleeps(proc: subprocess.Popen[str], sandboxes: Path, episodes: int) -> None:
    deadline = time.monotonic() + 120
    while _sleeping(sandboxes) < episodes:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        if time.monotonic() > deadline:
            running: dict[str, list[str]] = {}
            for pid in _in_sandboxes(sandboxes):
                running.setdefault(Path(_sandbox_of(pid)).name, []).append(_describe(pid))
            pytest.fail(
                f"{_sleeping(sandboxes)} of {episodes} agents reached their sleep in 120 s; "
                f"running, by sandbox: {running}; "
                f"sandboxes: {sorted(p.name for p in sandboxes.iterdir())}"
            )
        time.sleep(0.2)
    assert _descendants(proc.pid), "the run has no child processes to leave behind"
