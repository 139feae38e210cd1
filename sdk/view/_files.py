"""Opening a run directory's files as what they claim to be: regular files of bounded size.

A run directory may come from anywhere (a colleague's tarball, an issue attachment), and
`plies view` and `plies replay` must neither hang nor fill memory on one that was crafted: a
`run.json` that is a FIFO blocks `read()` forever, one that links to `/dev/zero` never ends.
So every file is opened without blocking, checked with `fstat` on the very descriptor it is
read from (no window between the check and the read), refused unless it is a regular file,
and read only up to its cap.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

from pydantic import ValidationError

from plies import ConfigError

__all__ = [
    "JSONL_CAP",
    "JSON_CAP",
    "LINE_CAP",
    "RunFileError",
    "first_error",
    "iter_lines",
    "open_regular",
    "read_regular",
]

JSON_CAP = 64 << 20
"""Bytes of a one-object file (`run.json`, `summary.json`, `policy.json`, ...): a default
run's `summary.json` is a few kilobytes."""
JSONL_CAP = 4 << 30
"""Bytes of a record log (`groups.jsonl`, `metrics.jsonl`): a default run's `groups.jsonl`
is tens of megabytes, so this only stops a file that is not a run's."""
LINE_CAP = 256 << 20
"""Bytes of one record line: a group of sixteen ten-turn episodes is well under a megabyte."""


class RunFileError(ConfigError):
    """A run file that cannot be one: not a regular file, or larger than its cap."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: Path, cap: int) -> tuple[int, int]:
    """Open `path` for reading; return (descriptor, size).

    Raises:
        FileNotFoundError: there is no such file (callers decide whether that is a problem).
        RunFileError: it is not a regular file, is larger than `cap`, or does not open.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise RunFileError(f"{path} does not open ({exc.strerror or exc})") from None
    checked = False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RunFileError(f"{path} is {_kind(st.st_mode)}, not a regular file")
        if st.st_size > cap:
            raise RunFileError(f"{path} holds {st.st_size:,} bytes, more than the {cap:,} allowed")
        os.set_blocking(fd, True)
        checked = True
    finally:
        if not checked:
            os.close(fd)
    return fd, st.st_size


def read_regular(path: Path, cap: int = JSON_CAP, *, start: int = 0) -> bytes:
    """The bytes of the regular file `path` from `start`, at most `cap` bytes of file in all.

    Raises:
        FileNotFoundError: no such file.
        RunFileError: not a regular file, or larger than `cap`.
    """
    fd, size = open_regular(path, cap)
    with os.fdopen(fd, "rb") as f:
        f.seek(start)
        return f.read(max(0, size - start))  # never past the size fstat saw


def iter_lines(path: Path, cap: int = JSONL_CAP) -> Iterator[tuple[int, bytes]]:
    """The lines of the regular file `path`, numbered from 1, without their newlines.

    Raises:
        FileNotFoundError: no such file.
        RunFileError: not a regular file, larger than `cap`, or a line longer than `LINE_CAP`.
    """
    fd, size = open_regular(path, cap)
    with os.fdopen(fd, "rb") as f:
        left = size
        number = 0
        while left > 0:
            raw = f.readline(min(left, LINE_CAP + 1))
            if not raw:
                return
            left -= len(raw)
            number += 1
            if len(raw.rstrip(b"\n")) > LINE_CAP:
                raise RunFileError(f"{path}: line {number} is longer than {LINE_CAP:,} bytes")
            yield number, raw.rstrip(b"\n")


def first_error(exc: ValidationError) -> str:
    """A pydantic error as one line: where the first problem is, what it is, how many more."""
    detail = exc.errors()[0]
    where = ".".join(map(str, detail["loc"])) or "the record"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{where}: {detail['msg']}{more}"
