"""The faults a trial injects, each at a moment drawn from the trial's seed.

A `Plan` is a pure function of the suite seed and the trial's index, so
`PLIES_CHAOS_SEED=S PLIES_CHAOS_ONLY=i` replays trial i of a run with seed S exactly (timing
aside). Faults outside the loop's process are injected from the test process while the
loop's first run goes on (`inject`); the two that live inside it (a full disk on the sink, a
hung env teardown) and the faulty engine in front of the sampler are set up before it starts
(`loop_options`, `engine_for`).
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from chaos_engine import FaultyEngine
from chaos_lanes import Lane
from chaos_run import LoopRun

from plies.environments.reapers import reap_sandbox

KINDS = (
    "sigint-1",
    "sigint-2",
    "sigint-3",
    "sigterm",
    "kill-server",
    "kill-trainer-fb",
    "kill-trainer-optim",
    "hung-teardown",
    "sandbox-killed",
    "engine-5xx",
    "engine-garbage",
    "engine-silent",
    "disk-full",
)
KILLS_SERVER = ("kill-server", "kill-trainer-fb", "kill-trainer-optim")
WATCH_S = 30.0
"""Longest an injector waits for its moment (a training op, a sandbox command)."""


@dataclass(frozen=True)
class Plan:
    """One trial: which fault, and the numbers that place it."""

    index: int
    suite_seed: int
    kind: str
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def seed(self) -> int:
        """The loop's own seed (deals, sampling order)."""
        return random.Random(f"{self.suite_seed}/{self.index}/loop").randrange(1, 10**6)

    @property
    def replay(self) -> str:
        return (
            f"PLIES_CHAOS_SEED={self.suite_seed} PLIES_CHAOS_ONLY={self.index} "
            ".venv/bin/pytest tests/chaos -q"
        )


def plan(suite_seed: int, index: int) -> Plan:
    """Trial `index` of the suite seeded `suite_seed`: every kind once per round of `KINDS`."""
    order = list(KINDS)
    random.Random(suite_seed).shuffle(order)
    kind = order[index % len(order)]
    rng = random.Random(f"{suite_seed}/{index}")
    params: dict[str, Any]
    if kind.startswith("sigint"):
        count = int(kind[-1])
        params = {
            "delays": [rng.uniform(0.3, 2.5)] + [rng.uniform(0.05, 1.2) for _ in range(1, count)]
        }
    elif kind == "sigterm":
        params = {"delays": [rng.uniform(0.3, 2.5)]}
    elif kind == "kill-server":
        params = {"delay": rng.uniform(0.3, 3.0), "down_s": rng.uniform(0.0, 1.5)}
    elif kind == "kill-trainer-fb":
        params = {"hold": rng.random() < 0.5, "delay": rng.uniform(0.0, 0.25)}
    elif kind == "kill-trainer-optim":
        params = {"delay": rng.uniform(0.0, 0.25)}
    elif kind == "hung-teardown":
        params = {"nth": rng.randint(1, 10), "forever": rng.random() < 0.5}
    elif kind == "sandbox-killed":
        params = {"delay": rng.uniform(0.2, 2.5)}
    elif kind.startswith("engine"):
        params = {"after": rng.randint(0, 12), "count": rng.randint(2, 10), "seed": rng.random()}
    else:  # disk-full
        params = {"writes": rng.randint(0, 3), "fraction": rng.choice([0.0, rng.random()])}
    return Plan(index, suite_seed, kind, params)


def loop_options(p: Plan) -> dict[str, Any]:
    """What the loop's first run is told to do to itself."""
    if p.kind == "disk-full":
        return {"enospc": {"writes": p.params["writes"], "fraction": p.params["fraction"]}}
    if p.kind == "hung-teardown":
        return {"hang_teardown": dict(p.params), "sample_timeout_s": 20.0}
    if p.kind == "engine-silent":
        return {"sample_timeout_s": 2.0}  # a client that waits for a silent engine gives up
    return {}


def engine_for(p: Plan, lane: Lane) -> FaultyEngine | None:
    if not p.kind.startswith("engine"):
        return None
    fault = p.kind.removeprefix("engine-")
    return FaultyEngine(
        lane.url, fault, after=p.params["after"], count=p.params["count"], seed=p.params["seed"]
    )


def inject(p: Plan, run: LoopRun, lane: Lane, sandboxes: Path) -> str | None:
    """Inject the fault of `p` into the running loop; return what landed (None: nothing)."""
    if p.kind.startswith("sigint") or p.kind == "sigterm":
        signum = signal.SIGTERM if p.kind == "sigterm" else signal.SIGINT
        sent = 0
        for delay in p.params["delays"]:
            time.sleep(delay)
            if run.proc.poll() is not None:
                break
            run.proc.send_signal(signum)
            sent += 1
        run.signals_sent = sent
        return f"{sent} x {signal.Signals(signum).name}" if sent else None
    if p.kind == "kill-server":
        time.sleep(p.params["delay"])
        if run.proc.poll() is not None:
            return None
        lane.kill()
        time.sleep(p.params["down_s"])
        lane.start()
        return "killed mid-run, restarted"
    if p.kind in ("kill-trainer-fb", "kill-trainer-optim"):
        return _kill_trainer(p, run, lane)
    if p.kind == "sandbox-killed":
        time.sleep(p.params["delay"])
        return _kill_sandbox(run, sandboxes)
    return None  # set up before the run: landing is read from its effects


def _kill_trainer(p: Plan, run: LoopRun, lane: Lane) -> str | None:
    """kill -9 the server while the run's first forward_backward or optim_step is inside the
    trainer, then restart it. A forward_backward is held at `before_apply` (nothing applied
    yet) or caught in flight (anywhere up to its answer); an optim_step is caught in flight
    (its step, checkpoint or journal line may be half done)."""
    fb = p.kind == "kill-trainer-fb"
    suffix = "-fb" if fb else "-opt"
    if fb and p.params["hold"]:
        lane.post("/plies/test/hold", {"point": "before_apply", "timeout_s": WATCH_S * 2})
    deadline = time.monotonic() + WATCH_S
    while time.monotonic() < deadline and run.proc.poll() is None:
        in_flight = lane.trainer_state().get("in_flight") or ""
        if in_flight.startswith(run.run_id) and suffix in in_flight:
            time.sleep(p.params["delay"])
            lane.kill()
            lane.start()
            held = " (held before applying)" if fb and p.params["hold"] else ""
            return f"killed in {in_flight.removeprefix(run.run_id + '-')}{held}, restarted"
        time.sleep(0.01)
    return None


def _kill_sandbox(run: LoopRun, root: Path) -> str | None:
    """SIGKILL a command running in one of the run's sandboxes; failing that, remove a live
    sandbox from outside (processes killed, directory gone), as a reaper or OOM killer would."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and run.proc.poll() is None:
        for pid, _ in sandbox_processes(root):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            return f"SIGKILL of sandbox command {pid}"
        time.sleep(0.005)
    for path in sorted(root.glob("plies-sbx-*")):
        if anyio.run(reap_sandbox, "local-sandbox", str(path)):
            return f"sandbox {path.name} removed from outside"
    return None


def sandbox_processes(root: Path) -> list[tuple[int, str]]:
    """(pid, sandbox id) of every live process that runs in a sandbox under `root`."""
    needle = f"PLIES_SANDBOX_ID={root}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z":
            continue  # exited, waiting to be reaped by its parent
        for var in environ.split(b"\0"):
            if var.startswith(needle):
                found.append((int(entry.name), var.split(b"=", 1)[1].decode()))
    return found
