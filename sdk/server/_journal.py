"""The trainer's durable state under `STATE_DIR/trainer/`: journal, checkpoints, generation.

- `journal.jsonl`: one fsynced line per applied op (id, kind, request digest, result),
  written before the answer is sent. An op without a line was never applied; a torn last
  line is an op that crashed before it was answered, so reading cuts it off (and says so).
- `batches/<digest>.json`: each forward_backward request since the last checkpoint, written
  (and fsynced) before its journal line: what a reopened trainer redoes.
- `checkpoints/<step>/` + `CURRENT`: model and optimizer state, written (and fsynced) every
  `TrainerConfig.checkpoint_seconds` at an `optim_step`, before its journal line and with that
  line inside (`meta.json`), so a crash between the two is repaired on reopen. The steps
  journaled after it are redone from their batches. A crash mid-checkpoint leaves a `.tmp-*`
  directory, removed on reopen.
- `base`: the policy version the trainer started from, read while no checkpoint exists.
- `generation`: bumped each time the trainer opens, so results name the process lifetime
  that holds their gradients.

The Tinker API's op logs (`_tinker/_oplog.py`) are the same ledger: a `Journal` of their own
records, and their state checkpoints are `Checkpoints` too (written by `write_dir`, before the
`done` line they carry inside), so both wires make an op durable the same way.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._durable import append_line, fsync_dir, fsync_tree, write_atomic
from .._exceptions import TrainingError

__all__ = ["Batches", "Checkpoints", "Journal", "bump_generation", "write_dir"]

log = logging.getLogger(__name__)


def bump_generation(path: Path) -> int:
    """Durably count one more trainer lifetime in `path`; returns the new generation."""
    try:
        previous = int(path.read_text()) if path.exists() else 0
    except ValueError:
        raise TrainingError(f"{path} does not hold a generation number; it is damaged") from None
    write_atomic(path, f"{previous + 1}\n".encode())
    return previous + 1


class Journal:
    """The applied ops, one JSON line each, in the order they were applied."""

    def __init__(self, path: Path, required: tuple[str, ...] = ("op_id", "kind", "result")):
        """`required`: the keys every record holds (the Tinker op logs keep other records
        in the same durable format)."""
        self.path = path
        self.required = required

    def read(self) -> list[dict[str, Any]]:
        """Every whole record; a torn last line is cut off the file (with a warning).

        Raises:
            TrainingError: a whole line is not a record. That is damage, not a crash, and
                guessing past it could apply an op twice, so the trainer refuses to open.
        """
        if not self.path.exists():
            return []
        raw = self.path.read_bytes()
        records: list[dict[str, Any]] = []
        good = 0
        for number, line in enumerate(raw.splitlines(keepends=True), start=1):
            if not line.endswith(b"\n"):
                break
            records.append(_record(self.path, number, line, self.required))
            good += len(line)
        if good < len(raw):
            log.warning(
                "dropping a torn journal line of %d bytes (never answered)", len(raw) - good
            )
            with self.path.open("r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
        return records

    def append(self, record: dict[str, Any]) -> None:
        """Write one record durably before the op is answered."""
        append_line(self.path, json.dumps(record, separators=(",", ":")))


def _record(path: Path, number: int, line: bytes, required: tuple[str, ...]) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise TrainingError(
            f"{path}:{number} is not a journal record ({exc}); the trainer state is damaged: "
            "restore it from a backup or start from a new --state-dir"
        ) from None
    if not isinstance(record, dict) or not all(k in record for k in required):
        raise TrainingError(
            f"{path}:{number} is not a journal record (it lacks one of {', '.join(required)}); "
            "the trainer state is damaged: restore it or start from a new --state-dir"
        )
    return record


class Batches:
    """The forward_backward requests a reopened trainer may have to redo, named by digest.

    A checkpoint of model and optimizer is 3x the model; a batch is a few hundred kilobytes.
    Writing the batches at every op and the checkpoint only now and then keeps each step's
    durable write to the size of its data, and a reopen redoes the few steps in between.
    """

    def __init__(self, root: Path):
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    def write(self, digest: str, body: bytes) -> None:
        """Durably hold `body` under `digest` (the same request twice is one file)."""
        write_atomic(self._path(digest), body)

    def read(self, digest: str) -> bytes:
        """The request held under `digest`.

        Raises:
            TrainingError: it is missing, so a journaled step cannot be redone.
        """
        path = self._path(digest)
        if not path.exists():
            raise TrainingError(
                f"{path} is missing: a journaled step cannot be redone and the trainer state "
                "is damaged; restore it from a backup or start from a new --state-dir"
            )
        return path.read_bytes()

    def keep_only(self, digests: set[str]) -> None:
        """Remove every batch but those of `digests` (the ones a reopen could still need)."""
        kept = {self._path(d).name for d in digests}
        for old in self.root.iterdir():
            if old.name not in kept:
                old.unlink(missing_ok=True)

    def _path(self, digest: str) -> Path:
        name = digest.removeprefix("sha256:")
        if not name.isalnum():
            raise TrainingError(f"journal digest {digest!r} is not a sha256 digest; it is damaged")
        return self.root / f"{name}.json"


def write_dir(target: Path, fill: Callable[[Path], None]) -> None:
    """Write the directory `target` whole or not at all: `fill` writes its files into a temp
    directory beside it (`.tmp-*`), which is fsynced and renamed over `target`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}.", dir=target.parent))
    try:
        fill(tmp)
        fsync_tree(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(target.parent)


class Checkpoints:
    """State snapshots, one directory per step (or `seq_id`), `CURRENT` naming the last."""

    def __init__(self, root: Path):
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".tmp-*"):  # a crash mid-checkpoint
            shutil.rmtree(stale, ignore_errors=True)

    def current(self) -> Path | None:
        """The last complete checkpoint, or None before the first step.

        Raises:
            TrainingError: `CURRENT` names a directory that is not a whole checkpoint.
        """
        current = self.root / "CURRENT"
        if not current.exists():
            return None
        path = self.root / current.read_text().strip()
        if not (path / "meta.json").exists():
            raise TrainingError(f"{current} names {path}, which is not a complete checkpoint")
        return path

    def write(self, step: int, fill: Callable[[Path], None]) -> None:
        """Write checkpoint `step` and make it `CURRENT`. `fill` writes its files, `meta.json`
        among them with the journal record of the op it follows inside: it is written before
        that record is journaled, so a reopen repairs a crash between the two."""
        write_dir(self.root / str(step), fill)
        write_atomic(self.root / "CURRENT", f"{step}\n".encode())

    def prune(self, step: int, keep: int) -> None:
        """Remove all but the `keep` checkpoints up to `step`."""
        kept = {str(s) for s in range(step - keep + 1, step + 1)}
        for old in self.root.iterdir():
            if old.name.isdigit() and old.name not in kept:
                shutil.rmtree(old, ignore_errors=True)
