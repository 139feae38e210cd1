"""Writes that survive a crash: a reader finds the old content or the new, never half of one.

The runtime's quarantine report and the server's checkpoints, journal and policy store all
need the same few steps (temp file beside the target, fsync, rename, fsync the directory), so
they live here once. This module is root-private and imports nothing from plies subpackages,
so the server may use it without pulling in the runtime.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["append_line", "fsync_dir", "fsync_tree", "write_atomic"]


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries, so a rename or create inside it survives a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file directly inside `root`, then `root` itself, before it is renamed."""
    for f in Path(root).iterdir():
        if f.is_file():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(root)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` atomically and durably.

    The temp file sits in the target's directory (a rename never crosses file systems) under
    a unique name (two writers never share one), and is removed if anything fails before the
    rename.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def append_line(path: Path, line: str) -> None:
    """Append one line (a newline is added) and fsync it before returning.

    A crash mid-write can leave a torn last line; readers must treat a line without its
    newline as never written.
    """
    with Path(path).open("a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())
