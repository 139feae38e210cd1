"""The run log, `metrics.jsonl`: what happened, in order, and what a resumed run reads back."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from plies import ConfigError
from plies.runtime import JsonlSink, MalformedLine, read_jsonl

__all__ = ["RunLog"]


class RunLog:
    """`metrics.jsonl`: append-only and fsynced; each record a dict with a `kind` and a `time`.

    Reading back is strict: a torn last line is what a crash mid-write leaves (the event it
    described did not complete), so it is cut off and reported in `torn_tail` for the caller
    to say so; any other line that is not a record means the file was damaged or edited, and
    resuming on top of it could repeat or skip work, so it is an error.

    Raises:
        ConfigError: a line other than the last is not a JSON object, or a record has no
            `kind`.
    """

    def __init__(self, path: Path):
        self.path = path
        read = read_jsonl(path)
        damaged = [m for m in read.malformed if not m.torn]
        if damaged:
            bad = damaged[0]
            raise ConfigError(
                f"{path}:{bad.line}: not a run-log record ({bad.error}): {bad.preview!r}; "
                "repair or remove the line, or choose another --out"
            )
        for line, record in enumerate(read.records, start=1):  # no gaps: only the tail is bad
            if not isinstance(record.get("kind"), str):
                raise ConfigError(f"{path}:{line}: a record without a kind: {record!r:.120}")
        torn = [m for m in read.malformed if m.torn]  # at most one: the unterminated last line
        self.torn_tail: MalformedLine | None = torn[0] if torn else None
        if self.torn_tail is not None:
            _truncate(path, self.torn_tail.offset)
        self.records: list[dict[str, Any]] = read.records
        self._sink = JsonlSink(path).open()

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Append one record and fsync it before returning it."""
        record = {"kind": kind, "time": time.time(), **fields}
        self._sink.write(record, sync=True)
        self.records.append(record)
        return record

    def close(self) -> None:
        self._sink.close()

    def last(self, kind: str, **match: Any) -> dict[str, Any] | None:
        """The newest record of `kind` whose fields equal `match`, if any."""
        for r in reversed(self.records):
            if r["kind"] == kind and all(r.get(k) == v for k, v in match.items()):
                return r
        return None

    def all(self, kind: str) -> list[dict[str, Any]]:
        """Every record of `kind`, oldest first."""
        return [r for r in self.records if r["kind"] == kind]


def _truncate(path: Path, size: int) -> None:
    """Cut `path` to `size` bytes, durably, so that the next append starts a fresh line."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)
