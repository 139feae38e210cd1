"""JSONL sinks that a crash cannot corrupt, and a reader that hides nothing.

Each record is one line handed to the kernel in one `write` on a file opened with
`O_APPEND`, so a killed process leaves either the whole line or, at worst, a torn tail that
the next line cannot be glued onto: when a sink reopens a file whose last byte is not a
newline, it ends that torn line first. A group is fsynced before a `RolloutDriver` hands it
out (its scope's writer batches the groups that complete together into one fsync), so a group
handed to training is already on disk. The reader returns every well-formed record and a
`MalformedLine` for everything else, never skipping a line silently.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar, overload

from pydantic import BaseModel, ValidationError

from .._exceptions import TrajectoryError
from .._lifecycle import Lifecycle
from ..trajectory import Group

__all__ = ["JsonlRead", "JsonlSink", "MalformedLine", "read_jsonl"]

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")

PREVIEW_CHARS = 120


class JsonlSink(Lifecycle):
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
        self.repaired_tail = False
        self.records = 0
        self._fd = -1

    def __repr__(self) -> str:
        return f"<JsonlSink {str(self.path)!r} {self.lifecycle} records={self.records}>"

    def _noun(self) -> str:
        return f"sink {self.path}"

    def open(self) -> JsonlSink:
        """Open for appending, ending a torn last line first. A sink opens once."""
        self._open()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        size = os.fstat(self._fd).st_size
        if size:
            with open(self.path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    self._write_all(b"\n")
                    os.fsync(self._fd)
                    self.repaired_tail = True
        return self

    def __enter__(self) -> JsonlSink:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def write(self, record: BaseModel | dict[str, Any], *, sync: bool = False) -> None:
        """Append one record as one line; with `sync`, fsync before returning."""
        self._check_open("write")
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

    def sync(self) -> None:
        """Fsync every line written so far (a batch of `write` calls shares one fsync)."""
        self._check_open("sync")
        os.fsync(self._fd)

    def mark(self) -> tuple[int, int]:
        """Where the file ends now (bytes, records written), for `rollback`."""
        self._check_open("mark")
        return os.fstat(self._fd).st_size, self.records

    def rollback(self, mark: tuple[int, int]) -> None:
        """Cut off every line written since `mark`: a batch that failed part way leaves none."""
        self._check_open("rollback")
        size, self.records = mark
        os.ftruncate(self._fd, size)

    def _write_all(self, data: bytes) -> None:
        """Write all of `data`, or none of it: a write that fails part way (a full disk takes
        part of a line, then refuses the rest) is cut off the file before the error is raised,
        so a later line is never glued onto a torn one and the reader sees nothing of it."""
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError:
            if len(view) < len(data):
                with contextlib.suppress(OSError):  # the write's own error is the one to raise
                    os.ftruncate(self._fd, os.fstat(self._fd).st_size - (len(data) - len(view)))
            raise

    def close(self) -> None:
        """Flush to disk and close. Idempotent."""
        if self._close() and self._fd >= 0:
            try:
                os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = -1


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
class JsonlRead(Generic[R]):
    """Everything a JSONL file held: good records and the lines that were not."""

    records: list[R]
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


@overload
def read_jsonl(path: Path | str, model: type[M]) -> JsonlRead[M]: ...
@overload
def read_jsonl(path: Path | str, model: None = None) -> JsonlRead[dict[str, Any]]: ...
def read_jsonl(path: Path | str, model: type[M] | None = None) -> JsonlRead[Any]:
    """Read every record of `path` as `model` (None: JSON objects); report each line that isn't.

    A missing file reads as empty. Nothing is skipped silently: an empty line, a torn last
    line, or a line that is not a JSON object (or not a `model`) comes back as a
    `MalformedLine`, so the caller decides whether a damaged file is acceptable.
    """
    path = Path(path)
    records: list[Any] = []
    malformed: list[MalformedLine] = []
    if not path.exists():
        return JsonlRead(records, malformed)
    for number, offset, raw, ended in _lines(path):
        try:
            if not raw.strip():
                raise ValueError("empty line")
            records.append(_parse(raw, model))
        except (ValueError, ValidationError, TrajectoryError) as exc:  # a record's own checks
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


def _parse(raw: bytes, model: type[M] | None) -> M | dict[str, Any]:
    if model is not None:
        return model.model_validate_json(raw)
    record = json.loads(raw)  # JSONDecodeError and UnicodeDecodeError are ValueErrors
    if not isinstance(record, dict):
        raise ValueError(f"a JSON {type(record).__name__}, not an object")
    return record
