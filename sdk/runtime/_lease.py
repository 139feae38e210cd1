"""`Lease`: one borrowed resource, and the remote operations running on it.

A lease is `borrowed`, then `released` (torn down) or `quarantined` (its state is unknown: an
operation was cut off before it settled, or the teardown failed or timed out). The pool
decides which when the lease comes back; the lease only tracks what runs on it, so that the
pool can tell whether everything settled.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from enum import StrEnum
from typing import Generic, Protocol, TypeVar

from .._exceptions import UsageError
from ._remote import RemoteRef
from ._settle import SettleWatch, Settling, SettlingState

__all__ = ["Lease", "LeaseState"]

T = TypeVar("T")


class LeaseState(StrEnum):
    """Where a lease stands. Every borrowed lease ends released or quarantined."""

    BORROWED = "borrowed"
    """Lent to an episode."""
    RELEASED = "released"
    """Returned and torn down: nothing of it remains."""
    QUARANTINED = "quarantined"
    """Its state is unknown; never lent again, reported, teardown retried."""


class _Lender(Protocol):
    """What a lease reads from the pool that lent it."""

    settle_timeout: float
    aborting: bool


class Lease(Generic[T]):
    """One borrowed resource. Run remote work on it inside `operation(name)`.

    Attributes:
        id: unique within the process.
        resource: what the pool's factory created.
        remote_id: the remote id (sandbox id, process id) when the resource has one.
        kind: the resource kind, which picks a reaper in `plies reap`.
        also_held: further remote things the resource held, read at quarantine.
        state: a `LeaseState`.
        reason: why it was quarantined, when it was.
        unsettled: an operation on it was cut off before it settled, so what that operation
            did, and what a record made meanwhile claims about it, is unknown.
    """

    __slots__ = (
        "_lender",
        "_ops",
        "also_held",
        "id",
        "kind",
        "reason",
        "remote_id",
        "resource",
        "state",
        "unsettled",
    )

    def __init__(
        self, lender: _Lender, lease_id: str, resource: T, remote_id: str | None, kind: str
    ):
        self._lender = lender
        self.id = lease_id
        self.resource = resource
        self.remote_id = remote_id
        self.kind = kind
        self.also_held: list[RemoteRef] = []
        self.state = LeaseState.BORROWED
        self.reason: str | None = None
        self.unsettled = False
        self._ops: list[Settling] = []

    def __repr__(self) -> str:
        return f"<Lease {self.id} {self.kind}:{self.remote_id} {self.state}>"

    @property
    def in_flight(self) -> tuple[str, ...]:
        """Names of the operations running now."""
        return tuple(op.name for op in self._ops)

    @asynccontextmanager
    async def operation(
        self, name: str, *, timeout: float | None = None, watch: SettleWatch | None = None
    ) -> AsyncIterator[None]:
        """Mark a remote operation in flight.

        The body runs shielded. If the episode is cancelled meanwhile, the body gets the
        pool's `settle_timeout` more seconds to finish; if it does, the lease is released
        normally, otherwise the lease is quarantined.

        Args:
            name: what the operation does ("step", "exec"), for reports.
            timeout: an overall bound; when it hits, the outcome is unknown, the lease is
                quarantined and `OperationUnsettled` is raised.
            watch: the `SettleWatch` of the scope this block is entered in, when its caller
                has one (a loop making several remote calls per turn): no watcher is started.

        Raises:
            UsageError: the lease is no longer borrowed.
            OperationUnsettled: the operation was cut off (timeout or abort).
        """
        if self.state is not LeaseState.BORROWED:
            raise UsageError(f"lease {self.id} is {self.state}; operations need a borrowed lease")
        lender = self._lender
        op = Settling(name, settle_timeout=lender.settle_timeout, timeout=timeout, watch=watch)
        self._ops.append(op)
        try:
            async with op:
                if lender.aborting:
                    op.abort()
                yield
        finally:
            self._ops.remove(op)
            if op.state is SettlingState.UNSETTLED:
                self.unsettled = True
            if op.state is SettlingState.UNSETTLED and self.reason is None:
                self.reason = f"operation {name!r} did not settle"
                if op.timeout is not None:
                    self.reason += f" within its {op.timeout:g}s timeout"
                elif not lender.aborting:
                    self.reason += f" within settle_timeout={op.settle_timeout:g}s"
                else:
                    self.reason += " (aborted)"

    def _abort(self) -> None:
        for op in self._ops:
            op.abort()
