"""Reading a run directory for people: every file optional, every damaged line reported.

A viewer is used on runs that are going wrong, so nothing here raises on bad data: a missing
file, a torn last line, a record from an older version of plies becomes a `problem` (a
sentence the page shows) and the rest of the run is still read. Files are only ever read,
and read incrementally (`RunReader.refresh` parses only the bytes appended since the last
call), so a viewer serving a live run costs the run nothing but page-cache reads.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic import ValidationError

from plies import Group, PliesError, TrajectoryError
from plies.rl import RUN_SCHEMA
from plies.runtime import QuarantineReport
from plies.training import grpo_advantages

from ._files import (
    JSON_CAP,
    JSONL_CAP,
    LINE_CAP,
    RunFileError,
    first_error,
    open_regular,
    read_regular,
)

__all__ = ["GroupEntry", "RunReader", "RunSnapshot"]

PREVIEW_CHARS = 80
MAX_PROBLEMS = 50
"""Problems listed one by one; more are counted, so a badly damaged file stays readable."""

_Entry = TypeVar("_Entry")


def _long_line(path: Path, number: int) -> RunFileError:
    return RunFileError(f"{path}: line {number} is longer than {LINE_CAP:,} bytes")


@dataclass(slots=True)
class _Tail:
    """The complete lines of one append-only file, read from where the last read stopped.

    An unterminated last line is left for the next read (a writer may be mid-line); a file
    that shrank or was replaced is read again from the start.
    """

    path: Path
    offset: int = 0
    inode: int | None = None
    line_no: int = 0
    rest: bytes = b""

    def new_lines(self) -> tuple[list[tuple[int, bytes]], bool]:
        """Lines appended since the last call, numbered from 1, and whether it restarted.

        Raises:
            RunFileError: the file is not a regular file, is over its cap, or holds a line
                longer than `LINE_CAP`.
        """
        try:
            fd, size = open_regular(self.path, JSONL_CAP)
        except FileNotFoundError:
            restarted = self.inode is not None
            self.offset, self.inode, self.line_no, self.rest = 0, None, 0, b""
            return [], restarted
        with os.fdopen(fd, "rb") as f:
            inode = os.fstat(f.fileno()).st_ino
            restarted = False
            if self.inode is not None and (inode != self.inode or size < self.offset):
                self.offset, self.line_no, restarted = 0, 0, True
            self.inode = inode
            if size == self.offset:
                return [], restarted
            f.seek(self.offset)
            data = f.read(size - self.offset)
        end = data.rfind(b"\n") + 1
        if len(data) - end > LINE_CAP:
            raise _long_line(self.path, self.line_no + 1)
        self.offset += end
        self.rest = data[end:]
        lines = []
        for raw in data[:end].split(b"\n")[:-1]:
            self.line_no += 1
            if len(raw) > LINE_CAP:
                raise _long_line(self.path, self.line_no)
            lines.append((self.line_no, raw))
        return lines, restarted


@dataclass(slots=True)
class GroupEntry:
    """One group of `groups.jsonl`, parsed once, with its members' summary rows."""

    line: int
    group: Group
    members: list[dict[str, Any]]


@dataclass(slots=True)
class RunSnapshot:
    """What a run directory held at one read: records as plain JSON values, and problems."""

    run_dir: Path
    run: dict[str, Any] | None
    summary: dict[str, Any] | None
    metrics: list[dict[str, Any]]
    groups: list[GroupEntry]
    quarantine: dict[str, Any] | None
    problems: list[str] = field(default_factory=list)

    def steps(self) -> list[dict[str, Any]]:
        return [r for r in self.metrics if r.get("kind") == "step"]

    def evals(self) -> list[dict[str, Any]]:
        return [r for r in self.metrics if r.get("kind") == "eval"]


def _member_row(group: Group, index: int) -> dict[str, Any]:
    traj = group.trajectories[index]
    info = traj.info
    return {
        "m": index,
        "id": traj.id,
        "task": traj.task_id,
        "reward": traj.reward if traj.reward is None or math.isfinite(traj.reward) else None,
        "status": traj.status.value if traj.status else None,
        "stop": info.get("stop_reason"),
        "error": traj.error,
        "turns": len(traj.turns),
        "ill": sum(t.ill_formed for t in traj.turns),
        "fb": sum(t.fallback is not None for t in traj.turns),
        "q": len(info.get("quarantined_leases") or []),
        "sampled": sum(len(t.completion_ids) for t in traj.turns),
        "versions": sorted({t.policy.version for t in traj.turns}),
    }


def _with_advantages(group: Group, rows: list[dict[str, Any]]) -> None:
    """GRPO's advantage (reward minus the group mean), where every reward is a number."""
    rewards = [r["reward"] for r in rows]  # finite or None (`_member_row`)
    if rows and all(r is not None for r in rewards):
        for row, adv in zip(rows, grpo_advantages(rewards), strict=True):
            row["adv"] = adv
    for row in rows:
        row.setdefault("adv", None)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _strings(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(v, str) for v in x)


_FIELDS: dict[str, tuple[str, Any]] = {
    "kind": ("a string", lambda x: isinstance(x, str) and len(x) <= 64),
    "step": ("a whole number >= 0", lambda x: _is_int(x) and x >= 0),
    "time": ("a number", _is_number),
    "label": ("a string", lambda x: isinstance(x, str)),
    "return": ("a number", lambda x: x is None or _is_number(x)),
    "train_return": ("a number", lambda x: x is None or _is_number(x)),
    "stderr": ("a number", lambda x: x is None or _is_number(x)),
    "episodes": ("a whole number", lambda x: x is None or _is_int(x)),
    "hands": ("a whole number", lambda x: x is None or _is_int(x)),  # run logs before episodes
    "ci": ("two numbers", lambda x: isinstance(x, list) and len(x) == 2),
    "return_ci": ("two numbers", lambda x: isinstance(x, list) and len(x) == 2),
    "groups": ("a list of group ids", _strings),
    "refused": ("a list of strings", _strings),
    "policy": (
        "a policy record or a version",
        lambda x: _is_int(x) or (isinstance(x, dict) and _is_int(x.get("version"))),
    ),
}
"""The run-log fields the page reads, and what each must be: a record that breaks one is
listed as damaged, not shown (the page never has to guess what a string `step` means)."""


def _misfit(record: dict[str, Any]) -> str | None:
    """Why `record` is not a run-log record the page can show, or None."""
    for name, (what, fits) in _FIELDS.items():
        if name in record and not fits(record[name]):
            got = type(record[name]).__name__
            return f"{name} is {got} {_preview(json.dumps(record[name]).encode())!r}, not {what}"
    return None


class _Problems:
    """Problems of one file, listed up to `MAX_PROBLEMS`, then counted."""

    def __init__(self) -> None:
        self.listed: list[str] = []
        self.more = 0

    def add(self, text: str) -> None:
        if len(self.listed) < MAX_PROBLEMS:
            self.listed.append(text)
        else:
            self.more += 1

    def all(self, name: str) -> list[str]:
        extra = [f"{name}: {self.more} more damaged lines"] if self.more else []
        return self.listed + extra


def _preview(raw: bytes) -> str:
    return raw[:PREVIEW_CHARS].decode(errors="replace")


class _Damaged(Exception):
    """A line of a run's JSONL file that is not what the page can show; the message says
    which line and why."""


def _metric_record(number: int, raw: bytes) -> dict[str, Any]:
    """Line `number` of `metrics.jsonl` as a run-log record.

    Raises:
        _Damaged: it is not JSON, not a record, or a field is not what the page reads.
    """
    try:
        record = json.loads(raw)
    except ValueError as exc:
        raise _Damaged(f"metrics.jsonl: line {number} is not JSON ({exc})") from None
    if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
        raise _Damaged(f"metrics.jsonl: line {number} is not a run-log record")
    wrong = _misfit(record)
    if wrong is not None:
        raise _Damaged(f"metrics.jsonl: line {number}: {wrong}")
    return record


def _group_entry(number: int, raw: bytes) -> GroupEntry:
    """Line `number` of `groups.jsonl` as a group, with its members' rows.

    Raises:
        _Damaged: it is not a group this version of plies reads (the first reason why).
    """
    try:
        group = Group.model_validate_json(raw)
    except (ValueError, ValidationError, TrajectoryError) as exc:
        first = str(exc).splitlines()[0]
        if isinstance(exc, ValidationError):
            detail = exc.errors()[0]
            where = ".".join(map(str, detail["loc"])) or "the line"
            first = f"{where}: {detail['msg']}"
            if exc.error_count() > 1:
                first += f" (and {exc.error_count() - 1} more)"
        raise _Damaged(
            f"groups.jsonl: line {number} is not a group this version reads: {first}"
        ) from None
    rows = [_member_row(group, i) for i in range(len(group.trajectories))]
    _with_advantages(group, rows)
    return GroupEntry(number, group, rows)


class _Lines(Generic[_Entry]):
    """One append-only JSONL file of a run, parsed as it grows: the lines `parse` reads,
    and the problems of those it cannot (`_Damaged`). A file that restarted (`_Tail`) is
    parsed again from its first line, so nothing of its old content lingers."""

    def __init__(self, path: Path, parse: Callable[[int, bytes], _Entry]):
        self.tail = _Tail(path)
        self.name = path.name
        self.entries: list[_Entry] = []
        self.problems = _Problems()
        self._parse = parse

    def read(self) -> None:
        """Parse the lines appended since the last read.

        Raises:
            RunFileError: as `_Tail.new_lines`; what was parsed before is kept.
        """
        lines, restarted = self.tail.new_lines()
        if restarted:
            self.entries, self.problems = [], _Problems()
        for number, raw in lines:
            try:
                self.entries.append(self._parse(number, raw))
            except _Damaged as exc:
                self.problems.add(str(exc))


class RunReader:
    """Reads one run directory again and again, parsing only what was appended.

    Example::

        reader = RunReader(Path("runs/blackjack"))
        snap = reader.refresh()          # everything so far
        snap = reader.refresh()          # later: only new lines are parsed
    """

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self._metrics = _Lines(self.run_dir / "metrics.jsonl", _metric_record)
        self._groups = _Lines(self.run_dir / "groups.jsonl", _group_entry)

    def refresh(self, *, live: bool = False) -> RunSnapshot:
        """Read what changed; `live` means a torn last line may still be being written."""
        problems: list[str] = []
        if not self.run_dir.is_dir():
            problems.append(f"{self.run_dir} is not a directory")
        run = self._json_file("run.json", problems, "the run's options are unknown")
        if run is not None and run.get("schema", RUN_SCHEMA) != RUN_SCHEMA:
            problems.append(
                f"run.json is of schema {run['schema']!r}, and this plies reads schema "
                f"{RUN_SCHEMA} (docs/rl.md): records it does not know are left out"
            )
        summary = self._json_file(
            "summary.json", problems, "the run has not finished (or was cut off before it did)"
        )
        files = (self._metrics, self._groups)
        for lines in files:
            try:
                lines.read()
            except RunFileError as exc:  # a FIFO, a device, a file or line over its cap
                problems.append(str(exc))
        for lines in files:
            tail, name = lines.tail, lines.name
            if not tail.path.exists():
                problems.append(f"{name} is missing")
            elif tail.rest and not live:
                problems.append(
                    f"{name}: line {tail.line_no + 1} is torn (cut off by a crash): "
                    f"{_preview(tail.rest)!r}"
                )
        for lines in files:
            problems += lines.problems.all(lines.name)
        return RunSnapshot(
            run_dir=self.run_dir,
            run=run,
            summary=summary,
            metrics=list(self._metrics.entries),
            groups=list(self._groups.entries),
            quarantine=self._quarantine(problems),
            problems=problems,
        )

    def _json_file(self, name: str, problems: list[str], why: str) -> dict[str, Any] | None:
        path = self.run_dir / name
        try:
            value = json.loads(read_regular(path, JSON_CAP))
        except FileNotFoundError:
            problems.append(f"{name} is missing: {why}")
            return None
        except RunFileError as exc:
            problems.append(f"{name}: {exc}")
            return None
        except (OSError, ValueError, RecursionError) as exc:
            problems.append(f"{name} does not read as JSON ({exc})")
            return None
        if not isinstance(value, dict):
            problems.append(f"{name} holds a JSON {type(value).__name__}, not an object")
            return None
        return value

    def _quarantine(self, problems: list[str]) -> dict[str, Any] | None:
        path = self.run_dir / "quarantine.json"
        try:
            raw = read_regular(path, JSON_CAP)
        except FileNotFoundError:
            return None
        except PliesError as exc:
            problems.append(f"quarantine.json: {exc}")
            return None
        try:
            return QuarantineReport.model_validate_json(raw).model_dump(mode="json")
        except ValidationError as exc:
            problems.append(f"quarantine.json is not a quarantine report: {first_error(exc)}")
            return None
