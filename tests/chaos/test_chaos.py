"""Faults at random moments of a small real loop, and the invariants that must hold after each.

Each trial runs `chaos_loop.py` (reference server, driver, local sandboxes, trainer, sinks:
real processes and real HTTP) with one fault, then resumes it without one, and checks the
invariants of `chaos_trial.py`. Trials run on a few lanes side by side, each lane one shared
`plies serve` that only the faults that kill it restart. The table of trials, faults by kind
and invariants held is printed at the end of the session, with the seed that replays them:

    PLIES_CHAOS_SEED=S           the suite's seed (default: a fresh one, printed)
    PLIES_CHAOS_TRIALS=N         how many trials (default: every kind twice)
    PLIES_CHAOS_ONLY=i,j         run only these trials of seed S (a replay)
    PLIES_CHAOS_LANES=K          servers side by side (default 2)
"""

from __future__ import annotations

import os
import queue
import secrets
import shutil
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from chaos_faults import KINDS, Plan, plan
from chaos_lanes import Lane
from chaos_trial import INVARIANTS, Result, run_trial

SEED = int(os.environ.get("PLIES_CHAOS_SEED") or secrets.randbelow(10**6))
TRIALS = int(os.environ.get("PLIES_CHAOS_TRIALS") or 2 * len(KINDS))
ONLY = os.environ.get("PLIES_CHAOS_ONLY")
LANES = int(os.environ.get("PLIES_CHAOS_LANES") or 2)
SANDBOX_PYTHON = os.path.realpath(sys.executable)
"""The interpreter itself, not the venv's launcher: the game script needs only the standard
library, and a sandbox command then starts in a few milliseconds."""


def plans() -> list[Plan]:
    indices = [int(i) for i in ONLY.split(",")] if ONLY else range(TRIALS)
    return [plan(SEED, i) for i in indices]


@pytest.mark.timeout(1800)
def test_faults_at_random_moments_keep_every_invariant(tiny_model_dir, tmp_path, chaos_tables):
    todo = plans()
    work: queue.Queue[Plan] = queue.Queue()
    for p in todo:
        work.put(p)
    lanes = [Lane(f"lane{k}", tiny_model_dir, tmp_path / f"lane{k}") for k in range(LANES)]
    lanes = lanes[: len(todo)]
    results: list[Result] = []
    broken: list[str] = []
    started = time.monotonic()

    def drive(lane: Lane) -> None:
        try:
            lane.root.mkdir(parents=True)
            lane.start()
            while True:
                try:
                    p = work.get_nowait()
                except queue.Empty:
                    return
                results.append(run_trial(p, lane, tmp_path, SANDBOX_PYTHON))
        except Exception as exc:  # the lane's server: reported, and its trials counted missing
            broken.append(f"{lane.name}: {exc!r}")

    threads = [threading.Thread(target=drive, args=(lane,), name=lane.name) for lane in lanes]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for lane in lanes:
            lane.close()
    leaked = [pid for lane in lanes for pid in lane.pids if Path(f"/proc/{pid}").exists()]
    for lane in lanes:  # the policies and checkpoints are large; the journal and logs stay
        for bulky in ("policies", "trainer/checkpoints"):
            shutil.rmtree(lane.state_dir / bulky, ignore_errors=True)
    wall = time.monotonic() - started
    results.sort(key=lambda r: r.plan.index)
    chaos_tables.append(table(results, wall))

    assert not broken and len(results) == len(todo), f"lanes broke: {broken}"
    assert not leaked, f"servers left running: {leaked}"
    failures = [r for r in results if r.violations]
    assert not failures, "\n\n".join(describe(r) for r in failures)


def describe(r: Result) -> str:
    lines = [f"trial {r.plan.index} ({r.plan.kind}, {r.plan.params}, landed: {r.landed})"]
    for invariant, messages in r.violations.items():
        lines += [f"  {invariant}: {m}" for m in messages]
    lines.append(f"  replay: {r.plan.replay}")
    return "\n".join(lines)


def table(results: list[Result], wall: float) -> str:
    """Trials, faults by kind (how many landed) and how often each invariant held."""
    by_kind: dict[str, list[Result]] = {}
    for r in results:
        by_kind.setdefault(r.plan.kind, []).append(r)
    header = f"{'fault':<20}{'trials':>7}{'landed':>8}" + "".join(f"{i:>9}" for i in INVARIANTS)
    which = f"PLIES_CHAOS_ONLY={ONLY}" if ONLY else f"PLIES_CHAOS_TRIALS={TRIALS}"
    lines = [
        f"chaos: seed {SEED}, {len(results)} trials in {wall:.0f}s "
        f"(replay: PLIES_CHAOS_SEED={SEED} {which})",
        header,
        "-" * len(header),
    ]
    for kind in [k for k in KINDS if k in by_kind]:
        rows = by_kind[kind]
        held = Counter(i for r in rows for i in INVARIANTS if i not in r.violations)
        landed = sum(r.landed is not None for r in rows)
        lines.append(
            f"{kind:<20}{len(rows):>7}{landed:>8}"
            + "".join(f"{f'{held[i]}/{len(rows)}':>9}" for i in INVARIANTS)
        )
    held = Counter(i for r in results for i in INVARIANTS if i not in r.violations)
    landed = sum(r.landed is not None for r in results)
    lines.append("-" * len(header))
    lines.append(
        f"{'all':<20}{len(results):>7}{landed:>8}"
        + "".join(f"{f'{held[i]}/{len(results)}':>9}" for i in INVARIANTS)
    )
    violated = sum(bool(r.violations) for r in results)
    lines.append(f"invariant violations: {violated} trial(s)")
    for r in results:
        mark = "FAIL" if r.violations else "ok"
        lines.append(
            f"  #{r.plan.index:<3} {r.plan.kind:<19} {r.seconds:5.1f}s {mark:<4} "
            f"{r.landed or 'did not land'}"
        )
    return "\n".join(lines)
