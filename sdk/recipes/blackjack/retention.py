"""Which published policies a run keeps on disk, and the record of those it removed.

Every policy the trainer publishes is a whole model directory under `RUN_DIR/server/policies/
<version>/` (about 56 MB for the tiny model), so a run that kept them all would grow by one
per GRPO step. A run keeps:

- version 0, the server's copy of the base model (the server reopens its store from it);
- the warm start's policy (the warm-start evaluation, and `plies replay` of the first step's
  groups, sample from it);
- the newest `keep` policies (`--keep-policies`; the newest is what a resume serves and the
  final evaluation plays);
- while the run samples, every version a group in flight may still sample from (the newest
  `MAX_STALENESS + 1`); the sampler holds those in memory, and nothing older.

`RUN_DIR/retention.json` says what was removed, so a reader of the run (`plies replay`) can
tell a version that was not kept from one that never existed::

    {"keep_policies": 3, "kept": [0, 1, 29, 30, 31], "removed": [2, 3, ..., 28]}

(`keep_policies` is `"all"` when nothing is removed.) A version is removed by renaming its
directory to `.tmp-removed-<version>` first, a name the policy store deletes when it opens,
so a crash midway never leaves a directory that looks published but lacks its weights.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from plies.runtime import fsync_dir, write_atomic

from .config import MAX_STALENESS

__all__ = [
    "RETENTION_FILE",
    "kept_versions",
    "policies_dir",
    "prune_policies",
    "removed_versions",
]

RETENTION_FILE = "retention.json"
_POLICY_FILE = "policy.json"
"""What marks a published version's directory (the policy store's own marker)."""


def policies_dir(out: Path) -> Path:
    """Where the embedded `plies serve` publishes the run's policies."""
    return out / "server" / "policies"


def kept_versions(
    published: list[int], *, warm: int | None, keep: int | None, sampling: bool
) -> set[int]:
    """The versions of `published` to keep: see the module docstring."""
    if keep is None or not published:
        return set(published)
    newest = max(published)
    window = keep if not sampling else max(keep, MAX_STALENESS + 1)
    kept = {v for v in published if v > newest - window}
    kept.add(0)
    if warm is not None:
        kept.add(warm)
    return kept & set(published)


def removed_versions(out: Path) -> set[int]:
    """The versions `retention.json` says were removed (empty when it is absent)."""
    try:
        record = json.loads((out / RETENTION_FILE).read_text())
    except (OSError, ValueError):
        return set()
    removed = record.get("removed") if isinstance(record, dict) else None
    return {v for v in removed or [] if isinstance(v, int)}


def prune_policies(out: Path, *, warm: int | None, keep: int | None, sampling: bool) -> list[int]:
    """Remove the published policies `kept_versions` does not keep; return those removed.

    Writes `retention.json` (also when nothing was removed, so that it names the policy).
    """
    root = policies_dir(out)
    if not root.is_dir():  # a Tinker run: the service keeps its policies
        return []
    published = sorted(
        int(p.name) for p in root.iterdir() if p.name.isdigit() and (p / _POLICY_FILE).exists()
    )
    kept = kept_versions(published, warm=warm, keep=keep, sampling=sampling)
    gone = [v for v in published if v not in kept]
    for version in gone:
        doomed = root / f".tmp-removed-{version}"
        os.rename(root / str(version), doomed)
        fsync_dir(root)
        shutil.rmtree(doomed, ignore_errors=True)
    removed = sorted(removed_versions(out) | set(gone))
    record: dict[str, Any] = {
        "keep_policies": "all" if keep is None else keep,
        "kept": sorted(kept),
        "removed": removed,
    }
    write_atomic(out / RETENTION_FILE, (json.dumps(record) + "\n").encode())
    return gone
