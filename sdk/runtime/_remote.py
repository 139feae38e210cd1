"""`RemoteRef`: the one name plies has for remote state, and `HoldsRemote`, what holds it.

An env's sandbox, a server session, an agent process: anything that outlives a crash of the
run that made it. The runtime owns the type because it is the runtime that records such
things when it quarantines a lease and `plies reap` that tears them down; env authors get
it re-exported from `plies.environments`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["HoldsRemote", "RemoteRef", "locate"]

log = logging.getLogger("plies.runtime")


class RemoteRef(BaseModel):
    """Remote state, named so that it can be reported and reaped later."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str = Field(
        description="What it is ('e2b', 'local-sandbox', 'process'); `plies reap` picks a "
        "reaper by it."
    )
    id: str = Field(description="The remote id: enough, with `kind`, to tear it down.")
    detail: dict[str, str] = Field(default_factory=dict, description="Where it lives, etc.")


@runtime_checkable
class HoldsRemote(Protocol):
    """A resource that can say what remote state it holds right now (`Env` is one).

    A pool asks at create and again at quarantine, because the answer changes over a
    resource's life (an env makes its sandbox in `reset`, after the pool created the env).
    """

    def remote_refs(self) -> list[RemoteRef]:
        """The remote state held now; the first names the resource in a quarantine report."""
        ...


def locate(
    resource: Any, remote_id: Callable[[Any], str | None] | None, default_kind: str
) -> tuple[str | None, str, list[RemoteRef]]:
    """A resource's remote id, kind and further remote things, read now.

    The first of its `remote_refs()` names it, unless `remote_id` (a pool's override) says
    otherwise; a resource that holds no refs may still carry a `remote_id` or `sandbox_id`
    attribute and a `remote_kind`. This runs on the way to recording a resource, so a failure
    to read them (user code) must not lose the record: it leaves the id unknown, which
    `plies reap` reports.
    """
    try:
        refs = list(resource.remote_refs()) if isinstance(resource, HoldsRemote) else []
        if remote_id is not None:
            rid = remote_id(resource)
        elif refs:
            rid = refs[0].id
        else:
            rid = _attribute_remote_id(resource)
        kind = refs[0].kind if refs else getattr(resource, "remote_kind", None)
        return rid, kind or default_kind, refs[1:]
    except Exception as exc:
        log.warning("could not read the remote id of %s: %r", type(resource).__name__, exc)
        return None, default_kind, []


def _attribute_remote_id(resource: Any) -> str | None:
    for attr in ("remote_id", "sandbox_id"):
        value = getattr(resource, attr, None)
        if value is not None:
            return str(value)
    return None
