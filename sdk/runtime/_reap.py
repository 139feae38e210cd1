"""Tear down what a quarantine report says may still exist, after the run that made it.

A reaper is `async def reaper(remote_id) -> bool`: True when it tore the resource down, False
when the resource was already gone; it raises when it could not tell. Reapers are keyed by
resource kind and passed in explicitly. `builtin_reapers()` builds the runtime's own,
"process" (a local process group, by the id `process_remote_id(pid)` recorded); layers above
add theirs (`plies.environments.sandbox_reapers()` for sandboxes), and `plies reap` composes
them all.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import anyio

from .._exceptions import ConfigError
from ._report import read_report, write_report

__all__ = [
    "ReapOutcome",
    "ReapResult",
    "Reaper",
    "builtin_reapers",
    "process_remote_id",
    "reap_process",
    "reap_report",
]

Reaper = Callable[[str], Awaitable[bool]]

DEFAULT_REAP_TIMEOUT = 30.0
TERM_GRACE_S = 2.0


class ReapOutcome(StrEnum):
    KILLED = "killed"
    """The reaper tore it down."""
    GONE = "gone"
    """It no longer existed."""
    FAILED = "failed"
    """The reaper raised or timed out; it may still exist."""
    SKIPPED = "skipped"
    """No reaper for its kind, or no remote id: tear it down by hand."""
    PLANNED = "planned"
    """A dry run: a reaper would be tried."""


@dataclass(frozen=True, slots=True)
class ReapResult:
    lease_id: str
    kind: str
    remote_id: str | None
    outcome: ReapOutcome
    detail: str = ""


def _start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot), to detect pid reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22; the command name (field 2) may hold spaces, so split after its ')'.
    return stat.rsplit(")", 1)[1].split()[19]


def process_remote_id(pid: int) -> str:
    """The remote id of a local process group led by `pid`: "pid@starttime".

    The start time is the mark `reap_process` checks, so that it never signals a recycled
    pid or a process the run did not record.

    Raises:
        ConfigError: /proc has no start time for `pid` (it is gone, or this is not Linux).
    """
    start = _start_time(pid)
    if start is None:
        raise ConfigError(f"process {pid} has no start time in /proc; it cannot be recorded")
    return f"{pid}@{start}"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _parse_process_id(remote_id: str) -> tuple[int, str]:
    pid_text, at, start = remote_id.partition("@")
    if not (at and pid_text.isdigit() and start.isdigit()):
        raise ConfigError(
            f"process remote id {remote_id!r} is not 'pid@starttime', the form the runtime "
            "records; a bare pid could name any process, so it is refused"
        )
    return int(pid_text), start


async def reap_process(remote_id: str) -> bool:
    """SIGTERM the process group, then SIGKILL it after a grace period.

    Only what carries the marks the runtime recorded is signalled: the pid must still have
    the recorded start time (else it was recycled: the process is gone) and still lead its
    own process group (the runtime starts each in a new session), and the group is never
    this process's own.

    Raises:
        ConfigError: the id is not "pid@starttime", or names pid 1, this process or its group.
    """
    pgid, start = _parse_process_id(remote_id)
    if pgid <= 1 or pgid in (os.getpid(), os.getpgrp()):
        raise ConfigError(f"refusing to signal process group {pgid}: it is {_whose(pgid)}")
    if _start_time(pgid) != start:
        return False  # gone, or the pid was recycled: the process recorded is gone
    try:
        if os.getpgid(pgid) != pgid:
            raise ConfigError(
                f"process {pgid} no longer leads its process group; it is not the group "
                "the runtime recorded, so it is left alone"
            )
    except ProcessLookupError:
        return False
    if not _group_alive(pgid):
        return False
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + TERM_GRACE_S
    while time.monotonic() < deadline:
        if not _group_alive(pgid):
            return True
        await anyio.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    return True


def _whose(pgid: int) -> str:
    if pgid <= 1:
        return "the init process, or every process"
    return "this process" if pgid == os.getpid() else "this process's own group"


def builtin_reapers() -> dict[str, Reaper]:
    """The runtime's reapers, keyed by resource kind. A new dict each call, to extend."""
    return {"process": reap_process}


async def reap_report(
    path: Path | str,
    reapers: Mapping[str, Reaper],
    *,
    dry_run: bool = False,
    timeout: float = DEFAULT_REAP_TIMEOUT,
) -> list[ReapResult]:
    """Try each reaper on what the report at `path` says may still exist.

    An entry is marked torn down in the report (rewritten atomically) once everything it
    names, `remote_id` and `also_held`, was torn down or found gone, so a second run skips
    it. Returns one result per remote thing of each entry that may still exist.
    """

    async def reap(lease_id: str, kind: str, remote_id: str | None) -> ReapResult:
        reaper = reapers.get(kind)
        if remote_id is None or reaper is None:
            why = "no remote id recorded" if remote_id is None else "no reaper for kind"
            return ReapResult(lease_id, kind, remote_id, ReapOutcome.SKIPPED, why)
        if dry_run:
            return ReapResult(lease_id, kind, remote_id, ReapOutcome.PLANNED)
        try:
            with anyio.fail_after(timeout):
                killed = await reaper(remote_id)
        except Exception as exc:
            detail = f"timed out after {timeout:g}s" if isinstance(exc, TimeoutError) else repr(exc)
            return ReapResult(lease_id, kind, remote_id, ReapOutcome.FAILED, detail)
        return ReapResult(
            lease_id, kind, remote_id, ReapOutcome.KILLED if killed else ReapOutcome.GONE
        )

    path = Path(path)
    report = read_report(path)
    results: list[ReapResult] = []
    entries = list(report.entries)
    for i, entry in enumerate(entries):
        if not entry.may_exist:
            continue
        targets = [(entry.kind, entry.remote_id)]
        targets += [(ref.kind, ref.id) for ref in entry.also_held]
        outcomes = [await reap(entry.lease_id, kind, rid) for kind, rid in targets]
        results += outcomes
        if all(r.outcome in (ReapOutcome.KILLED, ReapOutcome.GONE) for r in outcomes):
            entries[i] = entry.model_copy(update={"torn_down": True, "reaped_at": time.time()})
    if not dry_run and entries != report.entries:
        write_report(path, report.model_copy(update={"entries": entries}))
    return results
