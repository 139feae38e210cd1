"""Training runs and their `save_weights` checkpoints, on disk under `STATE_DIR/tinker/`.

- `<run>/run.json`: written when a run (a tenant) is created, so `training_runs` lists it,
  and its checkpoints stay loadable, after the tenant is unloaded or the server restarts.
- `<run>/weights/<name>/`: `trainable.pt` (the tenant's trainable tensors by name: the LoRA
  adapter, or every weight of a full fine-tune), `optimizer.pt` (its AdamW state, once it
  has stepped) and `meta.json`. A checkpoint is written in a `.tmp-*` directory and renamed,
  so a reader finds the whole checkpoint or none.

Clients name checkpoints by `tinker://{run}/weights/{name}` (run = model id). Every such
path is checked before it touches the disk: three segments, a known run, a plain name (no
`/`, no leading `.`), so a client cannot reach outside the state directory.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from ..._durable import fsync_dir, write_atomic
from .._journal import write_dir
from .._quote import quoted
from ._errors import TinkerRequestError

__all__ = [
    "MAX_RUN_ID_CHARS",
    "CheckpointPath",
    "Runs",
    "SavedState",
    "check_name",
    "checkpoint_entry",
    "iso",
    "parse_tinker_path",
    "read_state",
    "run_dir_name",
    "sampler_entry",
    "write_state",
    "write_state_files",
]

RUN_FILE = "run.json"
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
"""A checkpoint name: one path segment that is never `.`, `..` or hidden."""

_KINDS = ("weights", "sampler_weights")


@dataclass(frozen=True)
class CheckpointPath:
    """A parsed `tinker://{run_id}/{kind}/{name}`."""

    run_id: str
    kind: str
    name: str

    @property
    def uri(self) -> str:
        return f"tinker://{self.run_id}/{self.kind}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"


def check_name(name: str) -> str:
    """Raises: TinkerRequestError: not a plain checkpoint name (400)."""
    if not NAME.fullmatch(name):
        raise TinkerRequestError(
            f"checkpoint name {quoted(name)} must be 1-128 letters, digits, '.', '_' or '-', "
            "not starting with '.'"
        )
    return name


def parse_tinker_path(path: str) -> CheckpointPath:
    """Raises: TinkerRequestError: not `tinker://{run}/weights|sampler_weights/{name}` (400)."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or not parts[0] or parts[1] not in _KINDS:
        raise TinkerRequestError(
            f"{quoted(path)} is not a checkpoint path of this server: "
            "tinker://{model_id}/weights/{name} or tinker://{model_id}/sampler_weights/{name}"
        )
    return CheckpointPath(parts[0], parts[1], check_name(parts[2]))


def run_dir_name(model_id: str) -> str:
    """The run's directory name: the model id with anything but `[A-Za-z0-9-_.]` as `_`."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in model_id)


def iso(t: float) -> str:
    """A POSIX time as the ISO datetime the SDK's models parse."""
    return datetime.fromtimestamp(t, UTC).isoformat()


def _size(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


@dataclass
class SavedState:
    """What a checkpoint restores: trainable tensors by name, and the AdamW state if any."""

    meta: dict[str, Any]
    trainable: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None


def write_state(target: Path, state: SavedState) -> None:
    """Write `state` as the directory `target`, whole or not at all (`_journal.write_dir`)."""
    write_dir(target, lambda directory: write_state_files(directory, state))


def write_state_files(directory: Path, state: SavedState) -> None:
    """Write `state`'s files into `directory`, as `read_state` reads them."""
    torch.save(state.trainable, directory / "trainable.pt")
    if state.optimizer is not None:
        torch.save(state.optimizer, directory / "optimizer.pt")
    (directory / "meta.json").write_text(json.dumps({**state.meta, "time": time.time()}))


def read_state(src: Path, *, optimizer: bool = True) -> SavedState:
    """What `write_state` wrote (the AdamW state only if asked for and saved)."""
    meta = json.loads((src / "meta.json").read_text())
    trainable = torch.load(src / "trainable.pt", map_location="cpu", weights_only=True)
    opt_file = src / "optimizer.pt"
    opt = (
        torch.load(opt_file, map_location="cpu", weights_only=True)
        if optimizer and opt_file.is_file()
        else None
    )
    return SavedState(meta, trainable, opt)


MAX_RUN_ID_CHARS = 200
"""The longest run (model) id: it names a directory, and file names stop at 255 bytes."""


class Runs:
    """The runs under `root` (`STATE_DIR/tinker`), each with its `save_weights` checkpoints."""

    def __init__(self, root: Path):
        self.root = root

    def dir(self, run_id: str) -> Path:
        """A run's directory, which may not exist yet."""
        name = run_dir_name(run_id)
        if name in (".", "..") or len(name) > MAX_RUN_ID_CHARS:
            raise TinkerRequestError(
                f"{quoted(run_id)} is not a training run id (1 to {MAX_RUN_ID_CHARS} characters)"
            )
        return self.root / name

    def create(self, run_id: str, meta: dict[str, Any]) -> Path:
        """Record a new run (before its first op runs); its directory."""
        root = self.dir(run_id)
        root.mkdir(parents=True, exist_ok=True)
        record = {"training_run_id": run_id, "created": time.time(), **meta}
        write_atomic(root / RUN_FILE, json.dumps(record).encode())
        return root

    def close(self, run_id: str) -> None:
        """Mark the run's tenant freed (unloaded or its session finished): a restarted
        server does not bring it back, though its checkpoints stay loadable."""
        record = {**self.get(run_id), "closed": True}
        write_atomic(self.dir(run_id) / RUN_FILE, json.dumps(record).encode())

    def get(self, run_id: str) -> dict[str, Any]:
        """The run's record. Raises: TinkerRequestError: no such run on this server (404)."""
        file = self.dir(run_id) / RUN_FILE
        record = json.loads(file.read_text()) if file.is_file() else None
        if record is None or record.get("training_run_id") != run_id:
            raise TinkerRequestError(f"unknown training run {quoted(run_id)}", status=404)
        return record

    def all(self) -> list[dict[str, Any]]:
        """Every run's record, oldest first."""
        if not self.root.is_dir():
            return []
        files = (d / RUN_FILE for d in self.root.iterdir())
        records = [json.loads(f.read_text()) for f in files if f.is_file()]
        return sorted(records, key=lambda r: r["created"])

    def weights_dir(self, path: CheckpointPath, *, exists: bool = True) -> Path:
        """Where a `weights` checkpoint lives, its run checked to exist.

        Raises:
            TinkerRequestError: a sampler path where training weights are needed (400), an
                unknown run, or (with `exists`) no such checkpoint (404).
        """
        if path.kind != "weights":
            raise TinkerRequestError(
                f"{path.uri} is sampler weights; this needs training weights "
                "(tinker://{model_id}/weights/{name}, from save_weights or save_state)"
            )
        self.get(path.run_id)
        target = self.dir(path.run_id) / "weights" / path.name
        if exists and not (target / "meta.json").is_file():
            raise TinkerRequestError(f"no checkpoint {path.uri} on this server", status=404)
        return target

    def write(
        self,
        path: CheckpointPath,
        state: SavedState,
        *,
        overwrite: bool,
    ) -> None:
        """Write a checkpoint whole (temp directory, fsync, rename).

        Raises:
            TinkerRequestError: the name is taken and `overwrite` is off (400).
        """
        target = self.weights_dir(path, exists=False)
        if target.exists() and not overwrite:
            raise TinkerRequestError(
                f"checkpoint {path.uri} already exists; pass overwrite=True to replace it"
            )
        write_state(target, state)

    def meta(self, path: CheckpointPath) -> dict[str, Any]:
        """A training checkpoint's `meta.json` (its run's LoRA config among it)."""
        return json.loads((self.weights_dir(path) / "meta.json").read_text())

    def read(self, path: CheckpointPath, *, optimizer: bool) -> SavedState:
        """A checkpoint's tensors (and its AdamW state, if asked and saved)."""
        return read_state(self.weights_dir(path), optimizer=optimizer)

    def checkpoints(self, run_id: str) -> list[dict[str, Any]]:
        """The run's training checkpoints as the SDK's `Checkpoint`, oldest first."""
        self.get(run_id)
        root = self.dir(run_id) / "weights"
        out = []
        for d in sorted(root.iterdir()) if root.is_dir() else ():
            if d.name.startswith(".") or not (d / "meta.json").is_file():
                continue
            meta = json.loads((d / "meta.json").read_text())
            path = CheckpointPath(run_id, "weights", d.name)
            out.append(
                checkpoint_entry(path, "training", meta["time"], _size(d), meta["user_metadata"])
            )
        return sorted(out, key=lambda c: c["time"])

    def delete(self, path: CheckpointPath) -> None:
        """Remove a training checkpoint. Raises: TinkerRequestError: none such (404)."""
        shutil.rmtree(self.weights_dir(path))
        fsync_dir(self.dir(path.run_id) / "weights")


def checkpoint_entry(
    path: CheckpointPath,
    kind: str,
    when: float,
    size: int,
    user_metadata: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One checkpoint as the SDK's `Checkpoint` model reads it."""
    entry: dict[str, Any] = {
        "checkpoint_id": path.checkpoint_id,
        "checkpoint_type": kind,
        "time": iso(when),
        "tinker_path": path.uri,
        "size_bytes": size,
        "public": False,
    }
    if user_metadata:
        entry["user_metadata"] = user_metadata
    return entry


def sampler_entry(path: CheckpointPath, policy_dir: Path) -> dict[str, Any]:
    """A named sampler snapshot as a `Checkpoint` (the snapshot's directory dates it)."""
    return checkpoint_entry(path, "sampler", policy_dir.stat().st_mtime, _size(policy_dir))
