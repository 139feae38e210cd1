"""Pools lend leases on resources they create and tear down, and quarantine what they cannot.

A pool creates one resource per borrow with a user-supplied async factory and tears it down
with a user-supplied async teardown (default: the resource's `aclose()` or `close()`), so it
knows nothing about what it lends: an env, a sandbox, an agent process. It bounds how many
resources may exist at once (a slot is taken before create and given back only after a
teardown succeeded) and how fast they are created.

A lease (`_lease.py`) comes back released or quarantined. A quarantined resource is never
lent again; its slot stays taken while it may exist, its teardown is retried in the
background, and it is recorded with its remote refs for the quarantine report.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import anyio
from anyio import CancelScope
from anyio.abc import TaskGroup

from .._exceptions import ConfigError, LeaseError, OperationUnsettled, PoolExhausted, UsageError
from .._lifecycle import AsyncLifecycle
from ._lease import Lease, LeaseState
from ._remote import locate
from ._report import QuarantineRecord
from ._settle import Settling, SettlingState

__all__ = ["EnvPool", "HarnessPool", "Pool", "PoolStatistics"]

T = TypeVar("T")

DEFAULT_LIMIT = 64
DEFAULT_CREATE_TIMEOUT = 120.0
DEFAULT_TEARDOWN_TIMEOUT = 30.0
DEFAULT_SETTLE_TIMEOUT = 10.0
DEFAULT_TEARDOWN_RETRIES = 3
DEFAULT_RETRY_BACKOFF = 1.0


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    """A snapshot of one pool. At rest, `borrowed == released + quarantined`."""

    name: str
    kind: str
    limit: int
    borrowed: int
    """Leases ever lent."""
    live: int
    """Leases lent and not yet returned."""
    released: int
    quarantined: int
    """Leases quarantined (whether or not a later teardown succeeded)."""
    may_exist: int
    """Quarantined resources (and lost creates) not known to be torn down."""
    creating: int
    create_failures: int
    slots_taken: int


async def _default_teardown(resource: Any) -> None:
    close = getattr(resource, "aclose", None) or getattr(resource, "close", None)
    if close is None:
        raise ConfigError(
            f"{type(resource).__name__} has no aclose() or close(); pass teardown= to the pool"
        )
    result = close()
    if inspect.isawaitable(result):
        await result


class Pool(AsyncLifecycle, Generic[T]):
    """Lends leases on resources made by `create` and removed by `teardown`.

    Open it with `async with` (`RolloutResources` does this for the pools it holds).

    Args:
        create: async factory of one resource.
        teardown: async teardown of one resource; default: `await r.aclose()` or `r.close()`.
        name: the pool's name in reports.
        kind: resource kind for `plies reap` ("process", or your own), used when a resource
            names none (its first `remote_refs()` kind, or its `remote_kind`).
        remote_id: returns a resource's remote id; default: the id of the first of its
            `remote_refs()` (an `Env`), else its `remote_id` or `sandbox_id`. Read at create
            and again at quarantine, so an id that appears later (an env's sandbox, made in
            `reset`) is reported.
        limit: most resources that may exist at once, quarantined ones included.
        creation_rate: most creates per second (None: unlimited).
        create_timeout: seconds a create may take; past it a resource may exist unseen.
        teardown_timeout: seconds a teardown may take before the lease is quarantined.
        settle_timeout: seconds an operation may go on after its episode is cancelled.
        teardown_retries: background teardown attempts for a quarantined resource.
        retry_backoff: seconds before the first retry, doubled each time.

    Example::

        pool = EnvPool(make_env, limit=32, creation_rate=8, kind="e2b")
        async with pool, pool.borrow() as lease:
            async with lease.operation("step"):
                await lease.resource.step(action)
    """

    default_name = "pool"

    def __init__(
        self,
        create: Callable[[], Awaitable[T]],
        *,
        teardown: Callable[[T], Awaitable[object]] | None = None,
        name: str | None = None,
        kind: str = "local",
        remote_id: Callable[[T], str | None] | None = None,
        limit: int = DEFAULT_LIMIT,
        creation_rate: float | None = None,
        create_timeout: float = DEFAULT_CREATE_TIMEOUT,
        teardown_timeout: float = DEFAULT_TEARDOWN_TIMEOUT,
        settle_timeout: float = DEFAULT_SETTLE_TIMEOUT,
        teardown_retries: int = DEFAULT_TEARDOWN_RETRIES,
        retry_backoff: float = DEFAULT_RETRY_BACKOFF,
    ):
        if not callable(create):
            raise ConfigError("create must be an async callable returning a resource")
        if limit < 1:
            raise ConfigError(f"limit must be at least 1, got {limit}")
        if creation_rate is not None and not creation_rate > 0:
            raise ConfigError(f"creation_rate must be positive or None, got {creation_rate}")
        for label, value in (
            ("create_timeout", create_timeout),
            ("teardown_timeout", teardown_timeout),
            ("settle_timeout", settle_timeout),
        ):
            if not value > 0:
                raise ConfigError(f"{label} must be positive, got {value}")
        if teardown_retries < 0 or retry_backoff < 0:
            raise ConfigError("teardown_retries and retry_backoff must not be negative")
        self.name = name or self.default_name
        self.kind = kind
        self.limit = limit
        self.creation_rate = creation_rate
        self.create_timeout = create_timeout
        self.teardown_timeout = teardown_timeout
        self.settle_timeout = settle_timeout
        self.teardown_retries = teardown_retries
        self.retry_backoff = retry_backoff
        self._create = create
        self._teardown = teardown or _default_teardown
        self._remote_id = remote_id
        self.aborting = False
        self._slots = anyio.Semaphore(limit)
        self._next_create_at = -math.inf
        self._ids = itertools.count(1)
        self._live: dict[str, Lease[T]] = {}
        self._records: dict[str, QuarantineRecord] = {}
        self._creates: set[Settling] = set()
        self._teardowns: set[CancelScope] = set()
        self._retries: set[CancelScope] = set()
        self._retrying = 0
        self._retries_done = anyio.Event()
        self._tg: TaskGroup | None = None
        self._borrowed = self._released = self._create_failures = 0
        self._may_exist = 0  # records whose resource may still exist; kept for O(1) borrows
        self._on_change: Callable[[], None] | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.lifecycle}>"

    # lifetime -------------------------------------------------------------------------------

    def _noun(self) -> str:
        return f"pool {self.name!r}"

    async def __aenter__(self) -> Pool[T]:
        self._open()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose(grace=self.teardown_timeout)

    async def aclose(self, *, grace: float = 0.0) -> None:
        """Stop lending; give background teardowns up to `grace` seconds, then stop them.

        Idempotent. Records of resources not torn down stay in `quarantined()`.
        """
        if not self._close() or self._tg is None:
            return
        tg, self._tg = self._tg, None
        try:
            with CancelScope(shield=True), anyio.move_on_after(0 if self.aborting else grace):
                if self._retrying:
                    await self._retries_done.wait()
        finally:
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)

    def abort(self) -> None:
        """Cut off every operation, create and teardown now; quarantine what is left.

        Leases returned from now on are quarantined without a teardown (reason "aborted"),
        and background retries stop: `plies reap` on the report finishes the job.
        """
        self.aborting = True
        for lease in self._live.values():
            lease._abort()
        for op in self._creates:
            op.abort()
        for scope in (*self._teardowns, *self._retries):
            scope.cancel()

    # lending --------------------------------------------------------------------------------

    @asynccontextmanager
    async def borrow(self) -> AsyncIterator[Lease[T]]:
        """Create a resource, lend it, and tear it down (or quarantine it) on the way out.

        Raises:
            UsageError: the pool is not open.
            PoolExhausted: every slot is held by a quarantined resource.
            LeaseError: the create failed or timed out.
        """
        self._check_lendable()
        await self._slots.acquire()
        made: list[Lease[T]] = []  # once a lease exists, its return frees the slot
        try:
            self._check_lendable()
            await self._pace()
            lease = await self._make_lease(made)
        finally:
            if not made:
                self._slots.release()
        try:
            yield lease
        finally:
            with CancelScope(shield=True):
                await self._return(lease)

    def _check_lendable(self) -> None:
        self._check_open("borrow (borrow inside `async with pool`)")
        if self.aborting:
            raise UsageError(f"pool {self.name!r} is aborting; it lends nothing more")
        if self._may_exist >= self.limit:
            raise PoolExhausted(
                f"pool {self.name!r}: all {self.limit} slots are held by quarantined resources "
                "that may still exist; reap them or raise the limit"
            )

    async def _pace(self) -> None:
        if self.creation_rate is None:
            await anyio.lowlevel.checkpoint()
            return
        now = anyio.current_time()
        at = max(now, self._next_create_at)
        self._next_create_at = at + 1.0 / self.creation_rate
        await anyio.sleep(at - now)

    async def _make_lease(self, made: list[Lease[T]]) -> Lease[T]:
        """Create a resource and register its lease in `made`.

        If the caller is cancelled once the resource exists (the cancellation is delivered
        as the shielded create ends), the new lease is returned (torn down or quarantined)
        here, so a created resource is never dropped.
        """
        lease_id = f"{self.name}-{next(self._ids)}"
        op = Settling("create", settle_timeout=self.settle_timeout, timeout=self.create_timeout)
        self._creates.add(op)
        handed_out = False
        try:
            async with op:
                try:
                    resource = await self._create()
                except Exception as exc:
                    self._create_failures += 1
                    raise LeaseError(f"pool {self.name!r}: create failed: {exc!r}") from exc
                remote_id, kind, _ = locate(resource, self._remote_id, self.kind)
                made.append(Lease(self, lease_id, resource, remote_id, kind))
                self._live[lease_id] = made[0]
                self._borrowed += 1
            handed_out = True
            return made[0]
        except OperationUnsettled as exc:
            raise LeaseError(f"pool {self.name!r}: {exc} (limit {self.create_timeout:g}s)") from exc
        finally:
            self._creates.discard(op)
            if not made and op.state is SettlingState.UNSETTLED:
                self._lost_create(lease_id, "create was cut off; a resource may exist unseen")
            if made and not handed_out:
                with CancelScope(shield=True):
                    await self._return(made[0])

    def _lost_create(self, lease_id: str, reason: str) -> None:
        self._create_failures += 1
        self._may_exist += 1
        self._records[lease_id] = QuarantineRecord(
            lease_id=f"create-{lease_id}",
            pool=self.name,
            kind=self.kind,
            remote_id=None,
            reason=reason,
            stage="create",
        )
        self._changed()

    async def _return(self, lease: Lease[T]) -> None:
        """Tear the lease's resource down, or quarantine it. Runs shielded."""
        del self._live[lease.id]
        if lease.reason is not None:
            self._quarantine(lease, lease.reason)
            return
        if self.aborting:
            self._quarantine(lease, "aborted before teardown")
            return
        error: str | None = None
        with CancelScope(deadline=anyio.current_time() + self.teardown_timeout) as scope:
            self._teardowns.add(scope)
            try:
                await self._teardown(lease.resource)
            except Exception as exc:
                error = f"teardown failed: {exc!r}"
            finally:
                self._teardowns.discard(scope)
        if scope.cancelled_caught:
            error = (
                "aborted during teardown"
                if self.aborting
                else f"teardown timed out after {self.teardown_timeout:g}s"
            )
        if error is not None:
            self._quarantine(lease, error)
            return
        lease.state = LeaseState.RELEASED
        self._released += 1
        self._slots.release()

    def _quarantine(self, lease: Lease[T], reason: str) -> None:
        # Read again: an env makes its sandbox in reset, after the pool created the env.
        remote_id, kind, also_held = locate(lease.resource, self._remote_id, self.kind)
        if remote_id is not None:
            lease.remote_id, lease.kind = remote_id, kind
        lease.also_held = also_held
        lease.state = LeaseState.QUARANTINED
        lease.reason = reason
        record = QuarantineRecord(
            lease_id=lease.id,
            pool=self.name,
            kind=lease.kind,
            remote_id=lease.remote_id,
            also_held=also_held,
            reason=reason,
        )
        self._records[lease.id] = record
        self._may_exist += 1
        self._changed()
        if self._tg is not None and not self.aborting and self.teardown_retries:
            self._retrying += 1
            self._tg.start_soon(self._retry_teardown, lease)

    async def _retry_teardown(self, lease: Lease[T]) -> None:
        with CancelScope() as retries:
            self._retries.add(retries)
            try:
                await self._retry_attempts(lease)
            finally:
                self._retries.discard(retries)
                self._retrying -= 1
                if not self._retrying:
                    self._retries_done.set()
                    self._retries_done = anyio.Event()

    async def _retry_attempts(self, lease: Lease[T]) -> None:
        for attempt in range(self.teardown_retries):
            await anyio.sleep(self.retry_backoff * 2**attempt)
            error: str | None = None
            with anyio.move_on_after(self.teardown_timeout) as scope:
                try:
                    await self._teardown(lease.resource)
                except Exception as exc:
                    error = repr(exc)
            if scope.cancelled_caught:
                error = f"timed out after {self.teardown_timeout:g}s"
            record = self._records[lease.id]
            done = error is None
            self._records[lease.id] = record.model_copy(
                update={
                    "teardown_attempts": record.teardown_attempts + 1,
                    "last_error": error,
                    "torn_down": done,
                }
            )
            self._changed()
            if done:
                self._may_exist -= 1
                self._slots.release()
                return

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

    # reporting ------------------------------------------------------------------------------

    def quarantined(self) -> list[QuarantineRecord]:
        """Every quarantine record so far, lost creates included."""
        return list(self._records.values())

    def statistics(self) -> PoolStatistics:
        records = self._records.values()
        return PoolStatistics(
            name=self.name,
            kind=self.kind,
            limit=self.limit,
            borrowed=self._borrowed,
            live=len(self._live),
            released=self._released,
            quarantined=sum(1 for r in records if r.stage == "lease"),
            may_exist=self._may_exist,
            creating=len(self._creates),
            create_failures=self._create_failures,
            slots_taken=self.limit - self._slots.value,
        )


class EnvPool(Pool[T]):
    """A pool of environments: one env instance (optionally with a sandbox) per trajectory."""

    default_name = "env"


class HarnessPool(Pool[T]):
    """A pool of harness resources, e.g. external agent processes behind a gateway."""

    default_name = "harness"
