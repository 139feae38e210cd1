"""One tenant's ordered ops on disk, so `kill -9` and a restart apply each op exactly once.

Under the run's directory (`STATE_DIR/tinker/<run>/`):

- `ops.jsonl`: a `submit` line (request id, `seq_id`, kind, body digest) written, with the
  body in `bodies/<seq_id>`, before the submit is answered; a `done` line (the result, or
  the error the future failed with) written before the future settles. A torn last line is
  a write that crashed before its answer went out, and reading drops it (`Journal`).
- `state/<seq_id>/` + `CURRENT`: the trainable tensors and AdamW state after each op that
  changes them (create, load, optim_step), written before that op's `done` line with the
  line inside, so a crash between the two is repaired on reading.

Recovery restores the last state and runs again every op after it, in `seq_id` order: the
forward_backwards since the last step rebuild its gradients (their journaled results stand),
and the ops that had not finished run for the first time. Nothing at or before the state's
`seq_id` runs twice. The saves after it that finished are not run again: their files are
already written, and their sampler registrations are in the samplers' own journal.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..._durable import fsync_dir, write_atomic
from .._journal import Checkpoints, Journal
from ._checkpoints import SavedState, read_state, write_state_files

__all__ = [
    "CHANGES_STATE",
    "DONE_FOR_GOOD",
    "OpLog",
    "Recovered",
    "Replay",
    "decode_result",
    "encode_result",
]

CHANGES_STATE = frozenset({"create", "load_weights", "optim_step"})
"""Kinds whose `done` follows a state checkpoint."""
DONE_FOR_GOOD = frozenset({"save_weights", "save_weights_for_sampler"})
"""Kinds not run again once they finished: what they did is on disk. Every other op after
the last state runs again (a finished one for what it left in memory, e.g. gradients)."""


def encode_result(value: bytes | dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, bytes):
        return {"proto": base64.b64encode(value).decode()}
    return {"json": value}


def decode_result(record: dict[str, Any]) -> bytes | dict[str, Any]:
    if "proto" in record:
        return base64.b64decode(record["proto"])
    return record["json"]


@dataclass(frozen=True)
class Replay:
    """An op brought back from the log: its request id, and whether it finished (its outcome
    is journaled already; it runs again only for what it left in memory)."""

    rid: str
    done: bool


@dataclass
class Recovered:
    """What the log holds: the last state (and its `seq_id`), then every op by `seq_id`."""

    state: SavedState | None = None
    state_seq: int = -1
    submits: dict[int, dict[str, Any]] = field(default_factory=dict)
    done: dict[int, dict[str, Any]] = field(default_factory=dict)


class OpLog:
    """The journal, request bodies and state checkpoints of one tenant."""

    def __init__(self, root: Path):
        self.root = root
        self.journal = Journal(root / "ops.jsonl", required=("event", "seq", "rid"))
        self.bodies = root / "bodies"
        self.bodies.mkdir(parents=True, exist_ok=True)
        self.states = Checkpoints(root / "state")

    def submitted(self, seq: int, rid: str, kind: str, digest: str, body: bytes) -> None:
        """Record an accepted op before its submit is answered."""
        write_atomic(self.bodies / str(seq), body)
        self.journal.append(
            {"event": "submit", "seq": seq, "rid": rid, "kind": kind, "digest": digest}
        )

    def body(self, seq: int) -> bytes:
        return (self.bodies / str(seq)).read_bytes()

    def done(self, seq: int, rid: str, value: bytes | dict[str, Any]) -> None:
        """Record an op's outcome before its future settles."""
        self.journal.append({"event": "done", "seq": seq, "rid": rid, **encode_result(value)})

    def checkpoint(self, seq: int, state: SavedState, rid: str, value: dict[str, Any]) -> None:
        """Make `state` (after op `seq`) the one recovery starts from, with that op's outcome
        inside; older states and the bodies of ops at or before `seq` are no longer needed."""
        done = {"event": "done", "seq": seq, "rid": rid, **encode_result(value)}
        meta = {"seq": seq, "done": done}
        saved = SavedState(meta, state.trainable, state.optimizer)
        self.states.write(seq, lambda directory: write_state_files(directory, saved))
        self.states.prune(seq, keep=1)
        for old in self.bodies.iterdir():
            if old.name.isdigit() and int(old.name) <= seq:
                old.unlink(missing_ok=True)
        fsync_dir(self.bodies)

    def read(self) -> Recovered:
        out = Recovered()
        for record in self.journal.read():
            by_event = out.submits if record["event"] == "submit" else out.done
            by_event[record["seq"]] = record
        current = self.states.current()
        if current is not None:
            seq = int(current.name)
            out.state, out.state_seq = read_state(current), seq
            if seq not in out.done:  # crashed between the checkpoint and its journal line
                done = out.state.meta["done"]
                self.journal.append(done)
                out.done[seq] = done
        return out
