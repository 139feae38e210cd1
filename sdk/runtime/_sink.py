"""JSONL sinks that a crash cannot corrupt, and a reader that hides nothing.

Each record is one line handed to the kernel in one `write` on a file opened with
`O_APPEND`, so a killed process leaves either the whole line or, at worst, a torn tail that
the next line cannot be glued onto: when a sink reopens a file whose last byte is not a
newline, it ends that torn line first. Groups are fsynced when written, so a group handed to
training is already on disk. The reader returns every well-formed record and a
`MalformedLine` for everything else, never skipping a line silently.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import TracebackType
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError

from .._exceptions import UsageError
from ..trajectory import Group

__all__ = ["JsonlRead", "JsonlSink", "MalformedLine", "SinkState", "read_groups", "read_jsonl"]

M = TypeVar("M", bound=BaseModel)

PREVIEW_CHARS = 120


class SinkState(StrEnum):
    UNOPENED = "unopened"
    OPEN = "open"
    CLOSED = "closed"


class JsonlSink:
    """Appends records to one JSONL file; resuming a run appends to the same file.

    Attributes:
        repaired_tail: the file ended in a torn line (an older crash) that was terminated
            on open; `read_jsonl` reports that line as malformed.
        records: lines written by this sink.

    Example::

        with JsonlSink(run_dir / "groups.jsonl") as sink:
            sink.write_group(group)      # one line, fsynced
    """

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.state = SinkState.UNOPENED
        self.repaired_tail = False
        self.records = 0
        self._fd = -1

    def __repr__(self) -> str:
        return f"<JsonlSink {str(self.path)!r} {self.state} records={self.records}>"

    def open(self) -> JsonlSink:
        if self.state is not SinkState.UNOPENED:
            raise UsageError(f"sink {self.path} is {self.state}; a sink opens once")
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        size = os.fstat(self._fd).st_size
        if size:
            with open(self.path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    self._write_all(b"\n")
                    os.fsync(self._fd)
                    self.repaired_tail = True
        self.state = SinkState.OPEN
        return self

    def __enter__(self) -> JsonlSink:
        return self.open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def write(self, record: BaseModel | dict[str, Any], *, sync: bool = False) -> None:
        """Append one record as one line; with `sync`, fsync before returning."""
        if self.state is not SinkState.OPEN:
            raise UsageError(f"sink {self.path} is {self.state}; open it before writing")
        if isinstance(record, BaseModel):
            text = record.model_dump_json()
        else:
            text = json.dumps(record, separators=(",", ":"))
        self._write_all(text.encode() + b"\n")
        self.records += 1
        if sync:
            os.fsync(self._fd)

    def write_group(self, group: Group) -> None:
        """Append a complete group (its trajectories inside) and fsync."""
        self.write(group, sync=True)

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def close(self) -> None:
        """Flush to disk and close. Idempotent."""
        if self.state is SinkState.OPEN:
            try:
                os.fsync(self._fd)
            finally:
                os.close(self._fd)
        self.state = SinkState.CLOSED


@dataclass(frozen=True, slots=True)
class MalformedLine:
    """A line the reader could not use, and why."""

    line: int
    """1-based line number."""
    offset: int
    """Byte offset of the line's start."""
    error: str
    preview: str
    """The line's start, for a human."""
    torn: bool
    """The last line, without a newline: a write cut short by a crash."""


@dataclass(frozen=True, slots=True)
class JsonlRead(Generic[M]):
    """Everything a JSONL file held: good records and the lines that were not."""

    records: list[M]
    malformed: list[MalformedLine]

    @property
    def clean(self) -> bool:
        return not self.malformed


def _lines(path: Path) -> Iterator[tuple[int, int, bytes, bool]]:
    offset = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            ended = raw.endswith(b"\n")
            yield number, offset, raw.rstrip(b"\n"), ended
            offset += len(raw)


def read_jsonl(path: Path | str, model: type[M]) -> JsonlRead[M]:
    """Read every record of `path` as `model`; report each line that is not one.

    A missing file reads as empty.
    """
    path = Path(path)
    records: list[M] = []
    malformed: list[MalformedLine] = []
    if not path.exists():
        return JsonlRead(records, malformed)
    for number, offset, raw, ended in _lines(path):
        try:
            if not raw.strip():
                raise ValueError("empty line")
            records.append(model.model_validate_json(raw))
        except (ValueError, ValidationError) as exc:
            malformed.append(
                MalformedLine(
                    line=number,
                    offset=offset,
                    error=str(exc).splitlines()[0],
                    preview=raw[:PREVIEW_CHARS].decode(errors="replace"),
                    torn=not ended,
                )
            )
    return JsonlRead(records, malformed)


def read_groups(path: Path | str) -> JsonlRead[Group]:
    """Read a groups file written by `JsonlSink.write_group`."""
    return read_jsonl(path, Group)
