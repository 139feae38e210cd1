"""Which published policies a run keeps on disk, and the record of those it removed.

Every policy a trainer publishes through `plies serve` is a whole model directory under the
server's `STATE_DIR/policies/<version>/` (about 56 MB for the tiny model), so a run that kept
them all would grow by one per GRPO step. A run keeps:

- version 0, the server's copy of the base model (the server reopens its store from it);
- the warm start's policy, if the run had one (its evaluation, and `plies replay` of the
  first step's groups, sample from it);
- the newest `keep` policies (the newest is what a resume serves and a final evaluation
  plays);
- while the run samples, every version a group in flight may still sample from (the newest
  `max_staleness + 1`, `GRPOConfig.max_staleness`); the sampler holds those in memory, and
  nothing older.

`RUN_DIR/retention.json` says what was removed, so a reader of the run (`plies replay`) can
tell a version that was not kept from one that never existed::

    {"keep_policies": 3, "kept": [0, 1, 29, 30, 31], "removed": [2, 3, ..., 28]}

(`keep_policies` is `"all"` when nothing is removed.) A version is removed by renaming its
directory to `.tmp-removed-<version>` first, a name the policy store deletes when it opens,
so a crash midway never leaves a directory that looks published but lacks its weights.

Where the Tinker API holds the policies (sampler weights named by `tinker://` paths in the
run's log), the same versions are kept and the others are deleted through the API, on
`plies serve` or any other service. One the service will not delete stays, is left out of
`removed`, and is tried again at the next prune.

`retain` is the one entry: it prunes where the policies are, as their URIs say.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from plies import ConfigError, PolicyRef, TrainingError
from plies._durable import fsync_dir, write_atomic
from plies.policy._paths import policy_path

__all__ = [
    "RETENTION_FILE",
    "DeletesPolicies",
    "kept_versions",
    "removed_versions",
    "retain",
]

RETENTION_FILE = "retention.json"
_POLICY_FILE = "policy.json"
"""What marks a published version's directory (the policy store's own marker)."""


@runtime_checkable
class DeletesPolicies(Protocol):
    """A trainer whose service keeps the policies it publishes and deletes them on request
    (`TinkerTrainingClient`)."""

    async def delete_policy(self, policy: PolicyRef) -> None: ...


async def retain(
    out: Path,
    published: Sequence[PolicyRef],
    *,
    trainer: object,
    warm: int | None,
    keep: int | None,
    max_staleness: int | None,
) -> tuple[list[int], list[str]]:
    """Apply `keep` to the policies a run published, where they are kept; return the
    versions removed and, for each the service would not delete, why (it stays, and is
    tried again at the next call).

    `published`: every policy the run's log names, and one just published. Policies with
    `file://` URIs are a `plies serve` store's on this disk: the store's whole directory is
    pruned (a version published but never logged, cut off by a crash, goes too). Others are
    deleted through `trainer`, which must then delete policies (`DeletesPolicies`). Writes
    `out/retention.json` (also when nothing was removed, so that it names the policy).

    Raises:
        ConfigError: `keep` is set, the policies are not on this disk, and `trainer` cannot
            delete them.
    """
    if not published:
        return [], []
    newest = max(published, key=lambda p: p.version)
    if newest.uri.startswith("file:"):
        root = policy_path(newest).parent
        return _prune_store(out, root, warm=warm, keep=keep, max_staleness=max_staleness), []
    if isinstance(trainer, DeletesPolicies):
        return await _prune_service(
            out, trainer, published, warm=warm, keep=keep, max_staleness=max_staleness
        )
    if keep is not None:
        raise ConfigError(
            f"keep_policies={keep}: the run's policies ({newest.uri}) are kept by a service, "
            f"and {type(trainer).__name__} cannot delete them; keep them all (None)"
        )
    _record(out, keep, {p.version for p in published}, [])
    return [], []


def kept_versions(
    published: list[int], *, warm: int | None, keep: int | None, max_staleness: int | None
) -> set[int]:
    """The versions of `published` to keep: see the module docstring.

    Args:
        published: The versions published so far.
        warm: The warm start's version (None: none yet, or no warm start).
        keep: How many of the newest to keep (None: all).
        max_staleness: While the run samples, how many versions a group in flight may lag
            behind the newest (None: nothing samples now).
    """
    if keep is None or not published:
        return set(published)
    newest = max(published)
    window = keep if max_staleness is None else max(keep, max_staleness + 1)
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


def _prune_store(
    out: Path,
    root: Path,
    *,
    warm: int | None,
    keep: int | None,
    max_staleness: int | None,
) -> list[int]:
    """Remove from `root` (a `plies serve` state directory's `policies/`) the published
    policies `kept_versions` does not keep; return those removed."""
    if not root.is_dir():  # nothing published there yet
        return []
    published = sorted(
        int(p.name) for p in root.iterdir() if p.name.isdigit() and (p / _POLICY_FILE).exists()
    )
    kept = kept_versions(published, warm=warm, keep=keep, max_staleness=max_staleness)
    gone = [v for v in published if v not in kept]
    for version in gone:
        doomed = root / f".tmp-removed-{version}"
        os.rename(root / str(version), doomed)
        fsync_dir(root)
        shutil.rmtree(doomed, ignore_errors=True)
    _record(out, keep, kept, gone)
    return gone


async def _prune_service(
    out: Path,
    trainer: DeletesPolicies,
    published: Sequence[PolicyRef],
    *,
    warm: int | None,
    keep: int | None,
    max_staleness: int | None,
) -> tuple[list[int], list[str]]:
    """Delete on the service the sampler weights of the `published` policies that
    `kept_versions` does not keep. The base model (not sampler weights) is never deleted."""
    gone_before = removed_versions(out)
    by_version = {p.version: p for p in published if p.version not in gone_before}
    kept = kept_versions(sorted(by_version), warm=warm, keep=keep, max_staleness=max_staleness)
    gone: list[int] = []
    failures: list[str] = []
    for version in sorted(set(by_version) - kept):
        policy = by_version[version]
        if "/sampler_weights/" not in policy.uri:
            continue
        try:
            await trainer.delete_policy(policy)
        except TrainingError as exc:
            failures.append(str(exc))
        else:
            gone.append(version)
    _record(out, keep, set(by_version) - set(gone), gone)  # a refused one stays kept
    return gone, failures


def _record(out: Path, keep: int | None, kept: set[int], gone: list[int]) -> None:
    """Write `retention.json`: `removed` accumulates over every prune of the run."""
    record: dict[str, Any] = {
        "keep_policies": "all" if keep is None else keep,
        "kept": sorted(kept),
        "removed": sorted(removed_versions(out) | set(gone)),
    }
    write_atomic(out / RETENTION_FILE, (json.dumps(record) + "\n").encode())
