"""One trial: run the loop with one fault, resume it without, and check every invariant.

The invariants, as the table names them:

- `records`: no torn or lost record: every line of `groups.jsonl` parses, nothing written
  before is changed, every group the driver handed out is on disk once and whole, and the
  lines each run added are the groups its driver reported complete;
- `once`: no training op applied twice: in the server's journal every op id appears once,
  no forward_backward is consumed by two steps, each logged step was stepped at most once
  (exactly once when trained) on its own gradients, the trainer's steps are consecutive, and
  no gradients are left pending after the resumed run;
- `leaks`: no process, sandbox directory or server left: after each run (and `plies reap`)
  no sandbox of the trial exists and no process runs in one; a killed server is gone;
- `reaped`: every unsettled remote thing is in the quarantine report: the report is complete,
  lists exactly the leases the driver quarantined, names every sandbox still there, and
  `plies reap` tears all of them down;
- `resume`: the resumed run continues from the last published policy: it starts from the
  last policy the first run published, admits its first groups under it, every policy saved
  is published once in order, and the server ends serving the last one;
- `exit`: each run exits as it should (130 after SIGINT, 143 after SIGTERM, 0 otherwise and
  for every resumed run; non-zero on a full disk) with no traceback.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from chaos_faults import KILLS_SERVER, Plan, engine_for, inject, loop_options, sandbox_processes
from chaos_lanes import Lane
from chaos_run import LoopRun

from plies import Group, PolicyRef, Status
from plies.runtime import read_jsonl
from plies.runtime._report import read_report
from plies.testing import plies_command
from plies.wire.sampling import served_name

INVARIANTS = ("records", "once", "leaks", "reaped", "resume", "exit")
FIRST_STEPS, RESUMED_STEPS = 2, 3
"""Steps the first run aims for, and the resumed run: it always trains past the first."""
RUN_TIMEOUT_S = 180.0
LOOP_ATTEMPTS = ("first", "resumed")


@dataclass
class Result:
    plan: Plan
    landed: str | None = None
    violations: dict[str, list[str]] = field(default_factory=dict)
    seconds: float = 0.0

    def fail(self, invariant: str, message: str) -> None:
        self.violations.setdefault(invariant, []).append(message)

    def check(self, invariant: str, ok: bool, message: str) -> None:
        if not ok:
            self.fail(invariant, message)


def run_trial(p: Plan, lane: Lane, root: Path, python: str) -> Result:
    started = time.monotonic()
    result = Result(p)
    trial_dir = root / f"trial-{p.index:03d}-{p.kind}"
    run_dir = trial_dir / f"t{p.index:03d}x{p.seed}"
    sandboxes = trial_dir / "sandboxes"
    run_dir.mkdir(parents=True)
    sandboxes.mkdir()
    base = ensure_served(lane)
    common = {
        "trainer": lane.url,
        "model": served_name(base.version),
        "base": base.model_dump(),
        "seed": p.seed,
        "sandboxes": str(sandboxes),
        "python": python,
    }
    killed_pids: list[int] = []
    runs: list[LoopRun] = []
    try:
        engine = engine_for(p, lane)
        with engine if engine is not None else contextlib.nullcontext():
            config = {**common, **loop_options(p), "steps": FIRST_STEPS, "attempt": 1}
            config["sampler"] = engine.url if engine is not None else lane.url
            pids_before = list(lane.pids)
            first = LoopRun(run_dir, config)
            runs.append(first)
            if first.wait_for(lambda e: e["event"] == "ready", 60) is None:
                result.fail("exit", f"first run never got ready:\n{first.err[-2000:]}")
            else:
                result.landed = inject(p, first, lane, sandboxes)
            code, _ = first.finish(RUN_TIMEOUT_S)
            restarted = lane.pids[len(pids_before) :]
            killed_pids = [pids_before[-1], *restarted[:-1]] if restarted else []
            if engine is not None and engine.injected:
                result.landed = ", ".join(f"{n} x {v}" for v, n in sorted(engine.injected.items()))
        if lane.pids and p.kind in KILLS_SERVER:
            lane.post("/plies/test/release", {})
        if p.kind == "hung-teardown" and first.all("teardown_hangs"):
            forever = " (every retry)" if p.params["forever"] else " (once)"
            result.landed = f"teardown of env {p.params['nth']} hung{forever}"
        if p.kind == "disk-full" and "No space left on device" in first.err:
            result.landed = f"ENOSPC after {p.params['writes']} group writes"
        check_exit(result, first, code, first=True)
        check_run(result, first, run_dir, sandboxes, before=[], attempt=1)
        after_first = read_jsonl(run_dir / "groups.jsonl", Group).records
        log_first = read_jsonl(run_dir / "log.jsonl").records

        config = {**common, "sampler": lane.url, "steps": RESUMED_STEPS, "attempt": 2}
        second = LoopRun(run_dir, config)
        runs.append(second)
        code, _ = second.finish(RUN_TIMEOUT_S)
        check_exit(result, second, code, first=False)
        check_run(result, second, run_dir, sandboxes, before=[g.id for g in after_first], attempt=2)
        check_resume(result, second, run_dir, base, log_first, lane)
        check_once(result, run_dir, lane)
        for pid in killed_pids:
            result.check("leaks", not Path(f"/proc/{pid}").exists(), f"killed server {pid} lives")
    except Exception as exc:  # a broken trial is a violation, never a silent pass
        result.fail("exit", f"the trial itself failed: {exc!r}")
    finally:
        for run in runs:
            if run.proc.poll() is None:
                run.finish(0.1)
    result.seconds = time.monotonic() - started
    return result


def ensure_served(lane: Lane) -> PolicyRef:
    """The lane's newest policy, served (a trial that broke may have left it unpublished)."""
    latest = PolicyRef.model_validate(lane.latest_policy())
    served = {card["id"] for card in lane.get("/v1/models")["data"]}
    name = served_name(latest.version)
    if name not in served:
        path = latest.uri.removeprefix("file://")
        lane.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
    return latest


# -- the checks -------------------------------------------------------------------------------


def check_exit(result: Result, run: LoopRun, code: int, *, first: bool) -> None:
    kind = result.plan.kind
    which = "first" if first else "resumed"
    err = run.err
    if first and kind.startswith("sigint") and run.signals_sent:
        expected = 130
    elif first and kind == "sigterm" and run.signals_sent:
        expected = 143
    elif first and kind == "disk-full" and result.landed:
        # The run cannot record, so it must stop and say why; the error reaches the script
        # (`groups()` raises it), which here does not catch it: a traceback is its due.
        result.check("exit", code not in (0, 130, 143), f"first run exited {code} on a full disk")
        result.check("exit", "No space left on device" in err, f"ENOSPC not reported:\n{err}")
        return
    else:
        expected = 0
    result.check(
        "exit", code == expected, f"{which} run exited {code}, not {expected}:\n{err[-3000:]}"
    )
    result.check("exit", "Traceback" not in err, f"{which} run printed a traceback:\n{err[-3000:]}")
    result.check("exit", not run.noise, f"{which} run printed non-events: {run.noise[:3]}")


def check_run(
    result: Result, run: LoopRun, run_dir: Path, sandboxes: Path, *, before: list[str], attempt: int
) -> None:
    """`records`, `reaped` and `leaks` for one run; reaps what its report lists."""
    which = LOOP_ATTEMPTS[attempt - 1]
    read = read_jsonl(run_dir / "groups.jsonl", Group)
    groups = read.records
    ids = [g.id for g in groups]
    stats = run.one("stats")
    result.check("records", not read.malformed, f"{which}: malformed lines {read.malformed}")
    result.check("records", ids[: len(before)] == before, f"{which}: earlier groups changed")
    result.check("records", len(ids) == len(set(ids)), f"{which}: a group written twice: {ids}")
    task_ids = [g.task_id for g in groups]
    result.check("records", len(task_ids) == len(set(task_ids)), f"{which}: a task played twice")
    result.check("records", all(g.complete for g in groups), f"{which}: an incomplete group")
    handed = {e["id"] for e in run.all("group")}
    result.check(
        "records",
        handed <= set(ids),
        f"{which}: handed out, not on disk: {sorted(handed - set(ids))}",
    )
    new = groups[len(before) :]
    if stats is None:
        result.fail("records", f"{which}: no stats (the run died)")
        return
    result.check(
        "records",
        len(new) == stats["groups_complete"],
        f"{which}: {len(new)} groups written, the driver reported {stats['groups_complete']}",
    )
    result.check(
        "records",
        sum(stats["settled"].values()) == stats["admitted"],
        f"{which}: settled {stats['settled']} of {stats['admitted']} admitted",
    )
    result.check("records", stats["live"] == 0, f"{which}: {stats['live']} leases still live")
    result.check(
        "records",
        stats["borrowed"] == stats["released"] + stats["quarantined"],
        f"{which}: lease accounting {stats}",
    )

    report_path = run_dir / f"quarantine-{attempt}.json"
    if not report_path.exists():
        result.fail("reaped", f"{which}: no quarantine report")
        return
    report = read_report(report_path)
    result.check("reaped", report.complete, f"{which}: the report was not completed")
    leases = {e.lease_id: e for e in report.entries if e.stage == "lease"}
    result.check(
        "reaped",
        len(leases) == stats["quarantined"],
        f"{which}: report lists "
        f"{len(leases)} leases, the driver quarantined {stats['quarantined']}",
    )
    for g in new:
        for t in g.trajectories:
            named = {q["lease"] for q in t.info.get("quarantined_leases", [])}
            result.check(
                "reaped",
                named <= set(leases),
                f"{which}: {t.id} names {named} that the report lacks",
            )
            if t.status is Status.QUARANTINED:
                result.check("reaped", bool(named), f"{which}: {t.id} quarantined, no lease")
    may_exist = set()
    for entry in report.may_exist:
        may_exist |= {entry.remote_id, *(ref.id for ref in entry.also_held)}
    alive = {str(path) for path in sandboxes.glob("plies-sbx-*")}
    alive |= {sandbox for _, sandbox in sandbox_processes(sandboxes)}
    result.check(
        "reaped",
        alive <= may_exist,
        f"{which}: sandboxes left that the report does not name: {sorted(alive - may_exist)}",
    )
    if report.may_exist:
        reap = subprocess.run(
            plies_command("reap", str(report_path)), capture_output=True, text=True, timeout=120
        )
        outcomes = [line.split()[0] for line in reap.stdout.splitlines()[:-1] if line.strip()]
        skipped = sum(e.remote_id is None for e in report.may_exist)
        result.check(
            "reaped",
            "failed" not in outcomes and outcomes.count("skipped") == skipped,
            f"{which}: plies reap: {reap.stdout}{reap.stderr}",
        )
        result.check(
            "reaped",
            reap.returncode == (1 if skipped else 0),
            f"{which}: plies reap exited {reap.returncode}: {reap.stdout}",
        )
        left = read_report(report_path).may_exist
        result.check(
            "reaped",
            all(e.remote_id is None for e in left),
            f"{which}: still may exist after plies reap: {left}",
        )
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (sandboxes_left(sandboxes)):
        time.sleep(0.05)
    left = sandboxes_left(sandboxes)
    result.check("leaks", not left, f"{which}: left behind: {left}")


def sandboxes_left(root: Path) -> list[str]:
    dirs = [p.name for p in root.glob("plies-sbx-*")]
    procs = [f"pid {pid} in {Path(sbx).name}" for pid, sbx in sandbox_processes(root)]
    return dirs + procs


def _published(log: list[dict[str, Any]]) -> list[PolicyRef]:
    """The policies the trained steps of a run log saved and published, in order."""
    steps = [r for r in log if r["kind"] == "step" and r["trained"]]
    return [PolicyRef.model_validate(r["policy"]) for r in steps]


def check_resume(
    result: Result,
    run: LoopRun,
    run_dir: Path,
    base: PolicyRef,
    log_first: list[dict[str, Any]],
    lane: Lane,
) -> None:
    ready = run.one("ready")
    if ready is None:
        result.fail("resume", "the resumed run never got ready")
        return
    last = (_published(log_first) or [base])[-1]
    started = PolicyRef.model_validate(ready["policy"])
    result.check(
        "resume",
        started == last,
        f"resumed from v{started.version}, the last published was v{last.version}",
    )
    first_new = f"hand-{ready['first_index']}"
    for g in read_jsonl(run_dir / "groups.jsonl", Group).records:
        if g.id == first_new:
            result.check(
                "resume",
                g.policy == last,
                f"{first_new} was admitted under v{g.policy.version}, not v{last.version}",
            )
    log = read_jsonl(run_dir / "log.jsonl").records
    published = _published(log)
    versions = [base.version] + [p.version for p in published]
    result.check("resume", versions == sorted(set(versions)), f"policy versions {versions}")
    steps = [r["step"] for r in log if r["kind"] == "step"]
    result.check("resume", steps == list(range(RESUMED_STEPS)), f"steps logged: {steps}")
    saved = [
        PolicyRef.model_validate(r["result"]["policy"])
        for r in lane.journal()
        if r["kind"] == "save_policy" and r["op_id"].startswith(run_dir.name + "-")
    ]
    result.check(
        "resume",
        saved == published,
        f"saved {[p.version for p in saved]}, published {[p.version for p in published]}",
    )
    final = published[-1] if published else base
    try:
        serves = {card["id"] for card in lane.get("/v1/models")["data"]}
    except httpx.HTTPError as exc:
        result.fail("resume", f"the server does not answer: {exc!r}")
        return
    result.check(
        "resume",
        served_name(final.version) in serves,
        f"v{final.version} is not served: {sorted(serves)}",
    )


def check_once(result: Result, run_dir: Path, lane: Lane) -> None:
    journal = lane.journal()
    ids = Counter(r["op_id"] for r in journal)
    twice = sorted(op for op, n in ids.items() if n > 1)
    result.check("once", not twice, f"ops journaled twice: {twice}")
    consumed = Counter(op for r in journal for op in r.get("consumed", []))
    result.check(
        "once",
        not [o for o, n in consumed.items() if n > 1],
        f"forward_backward ops stepped twice: {consumed}",
    )
    optim_steps = [r["step"] for r in journal if r["kind"] == "optim_step"]
    first = optim_steps[0] if optim_steps else 1
    result.check(
        "once",
        optim_steps == list(range(first, first + len(optim_steps))),
        f"trainer steps not consecutive: {optim_steps}",
    )
    prefix = run_dir.name + "-"
    ours = {r["op_id"]: r for r in journal if r["op_id"].startswith(prefix)}
    log = read_jsonl(run_dir / "log.jsonl").records
    for record in (r for r in log if r["kind"] == "step"):
        opt = ours.get(f"{prefix}s{record['step']}-opt")
        if record["trained"]:
            result.check("once", opt is not None, f"step {record['step']} logged, never stepped")
        else:
            result.check("once", opt is None, f"untrained step {record['step']} was stepped")
        if opt is not None:
            own = all(op.startswith(f"{prefix}s{record['step']}-fb") for op in opt["consumed"])
            result.check("once", own, f"step {record['step']} stepped on {opt['consumed']}")
    state = lane.trainer_state()
    result.check("once", not state["pending"], f"gradients left pending: {state['pending']}")
    result.check(
        "once",
        state["step"] == (optim_steps[-1] if optim_steps else 0),
        f"trainer at step {state['step']}, journal holds {optim_steps}",
    )
