"""The quarantine report: what a run could not account for, written so it survives the run.

A quarantined resource may still exist remotely (a sandbox still billed, a process still
running). Its record names the pool, the resource kind and the remote id, so `plies reap`
can tear it down later without the run that made it. The file is rewritten atomically
(temporary file, fsync, rename) each time it changes, so even a SIGKILL leaves either the
previous or the next complete report, never half of one.
"""

from __future__ import annotations

import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .._durable import write_atomic
from .._exceptions import ConfigError
from ._remote import RemoteRef

__all__ = ["QuarantineRecord", "QuarantineReport", "read_report", "write_report"]

REPORT_VERSION = 1


class QuarantineRecord(BaseModel):
    """One resource the runtime could not account for."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lease_id: str = Field(description="The lease that held it, or `create-...` for a create.")
    pool: str = Field(description="Name of the pool that lent it.")
    kind: str = Field(description="Resource kind; `plies reap` picks a reaper by it.")
    remote_id: str | None = Field(description="Remote id (sandbox id, process id), if known.")
    also_held: list[RemoteRef] = Field(
        default_factory=list,
        description="Further remote things the resource held; reaped with it.",
    )
    reason: str = Field(description="Why it was quarantined.")
    stage: str = Field(default="lease", description="`lease`, or `create` for a lost create.")
    quarantined_at: float = Field(default_factory=time.time, description="Unix time.")
    torn_down: bool = Field(default=False, description="A later teardown succeeded.")
    teardown_attempts: int = Field(default=0, description="Teardowns tried after quarantine.")
    last_error: str | None = Field(default=None, description="Why the last teardown failed.")
    reaped_at: float | None = Field(default=None, description="When `plies reap` finished it.")

    @property
    def may_exist(self) -> bool:
        """The resource may still exist remotely."""
        return not self.torn_down


class QuarantineReport(BaseModel):
    """Every quarantined resource of one `RolloutResources` scope."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = REPORT_VERSION
    run_id: str
    written_at: float = Field(default_factory=time.time)
    complete: bool = Field(
        default=False, description="Written at scope exit; false while the run goes on."
    )
    entries: list[QuarantineRecord] = Field(default_factory=list)

    @property
    def may_exist(self) -> list[QuarantineRecord]:
        """Entries whose resource may still exist remotely."""
        return [e for e in self.entries if e.may_exist]


def write_report(path: Path, report: QuarantineReport) -> None:
    """Replace `path` with `report` atomically and durably."""
    write_atomic(Path(path), report.model_dump_json(indent=2).encode() + b"\n")


def read_report(path: Path) -> QuarantineReport:
    """Load a report.

    Raises:
        ConfigError: the file is missing or is not a quarantine report.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read quarantine report {path}: {exc}") from exc
    try:
        return QuarantineReport.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ConfigError(
            f"{path} is not a plies quarantine report: {where + ': ' if where else ''}"
            f"{first['msg']}{more}"
        ) from exc
