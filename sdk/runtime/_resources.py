"""`RolloutResources`: the scope that owns the policy client's pools and the quarantine report.

Everything an episode borrows comes from here, so leaving the scope is the one place where
the run accounts for all of it: pools stop lending, quarantined resources get a last chance
to be torn down, and the report of what may still exist remotely is written.

The scope also owns the one task that does durable writes (`DurableWriter`): report
rewrites, coalesced, and the driver's groups, batched, run in a worker thread, so neither an
fsync nor a report of a thousand entries stalls the event loop.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
from anyio import CancelScope
from anyio.abc import TaskGroup

from .._exceptions import ConfigError
from .._lifecycle import AsyncCloseable
from ._pool import Pool, PoolStatistics
from ._report import QuarantineRecord, QuarantineReport, write_report
from ._writer import DurableWriter

__all__ = ["ResourcesStatistics", "RolloutResources"]

DEFAULT_EXIT_GRACE = 10.0

log = logging.getLogger("plies.runtime")


@dataclass(frozen=True, slots=True)
class ResourcesStatistics:
    """Lease accounting over every pool. At rest `borrowed == released + quarantined`."""

    borrowed: int
    live: int
    released: int
    quarantined: int
    may_exist: int
    pools: tuple[PoolStatistics, ...]

    @property
    def balanced(self) -> bool:
        """Every lease ever lent is live, released or quarantined."""
        return self.borrowed == self.live + self.released + self.quarantined


class RolloutResources(AsyncCloseable):
    """Holds the sampler (the policy client) and the pools episodes borrow from.

    The sampler is held, not owned: open and close it yourself (its lifetime usually spans
    several scopes). Pools are owned: they open with the scope and close with it.

    Args:
        sampler: the policy client episodes sample from (`ctx.sampler`); which policy they
            sample is the driver's (`ctx.policy`, a `PolicyRef`).
        pools: the pools; names must be unique. `EnvPool` is named "env" and
            `HarnessPool` "harness" unless given another name.
        report_path: where the quarantine report goes. It is rewritten (off the event loop,
            one rewrite for a burst of changes) after a resource is quarantined, before any
            group that settled after it is handed out, and once more at exit. None: no file;
            records are logged.
        run_id: names the run in the report.
        exit_grace: seconds at exit for background teardowns of quarantined resources.

    Example::

        async with RolloutResources(sampler=client, pools=[EnvPool(make_env)],
                                    report_path=run_dir / "quarantine.json") as res:
            async with res.env.borrow() as lease:
                ...
    """

    def __init__(
        self,
        *,
        sampler: Any = None,
        pools: Iterable[Pool[Any]] = (),
        report_path: Path | str | None = None,
        run_id: str | None = None,
        exit_grace: float = DEFAULT_EXIT_GRACE,
    ):
        self.sampler = sampler
        self.pools: dict[str, Pool[Any]] = {}
        for pool in pools:
            if pool.name in self.pools:
                raise ConfigError(f"two pools are named {pool.name!r}; pass name= to one")
            self.pools[pool.name] = pool
        self.report_path = Path(report_path) if report_path is not None else None
        self.run_id = run_id or uuid.uuid4().hex
        self.exit_grace = exit_grace
        self.aborting = False
        self.writer = DurableWriter(self._report_write if self.report_path is not None else None)
        """The scope's durable writes; `RolloutDriver` queues its groups here."""
        self._tg: TaskGroup | None = None

    def __repr__(self) -> str:
        return f"<RolloutResources {self.run_id} pools={list(self.pools)} {self.lifecycle}>"

    @property
    def env(self) -> Pool[Any]:
        """The pool named "env"."""
        return self.pool("env")

    @property
    def harness(self) -> Pool[Any]:
        """The pool named "harness"."""
        return self.pool("harness")

    def pool(self, name: str) -> Pool[Any]:
        try:
            return self.pools[name]
        except KeyError:
            raise ConfigError(f"no pool named {name!r}; pools: {sorted(self.pools)}") from None

    async def __aenter__(self) -> RolloutResources:
        if self.report_path is not None and not self.report_path.parent.is_dir():
            raise ConfigError(f"report directory {self.report_path.parent} does not exist")
        self._open()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        opened: list[Pool[Any]] = []
        try:
            await self._tg.start(self.writer.run)
            for pool in self.pools.values():
                pool._on_change = self.writer.report_changed
                await pool.__aenter__()
                opened.append(pool)
        except BaseException:
            self._close()  # the pools opened so far are closed for good: so is the scope
            try:
                await self._close_pools(opened)
            finally:
                await self._stop_writer()
            raise
        return self

    async def aclose(self) -> None:
        """Close every pool (background teardowns get `exit_grace`), then write the report.

        Idempotent. The report is written even when this is cancelled.
        """
        if not self._close():
            return
        try:
            await self._close_pools(list(self.pools.values()))
        finally:
            try:
                with CancelScope(shield=True):
                    await self.writer.wait_idle()
                    await anyio.to_thread.run_sync(self._report_write(final=True))
            finally:
                await self._stop_writer()

    async def _stop_writer(self) -> None:
        tg, self._tg = self._tg, None
        if tg is not None:
            self.writer.stop()
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)

    async def _close_pools(self, pools: list[Pool[Any]]) -> None:
        # Pools close in reverse order of opening; each one even if the one before raised.
        if not pools:
            return
        try:
            await pools[-1].aclose(grace=0 if self.aborting else self.exit_grace)
        finally:
            await self._close_pools(pools[:-1])

    def abort(self) -> None:
        """Cut off every operation now; returns quarantine what they held (reason "aborted")."""
        self.aborting = True
        for pool in self.pools.values():
            pool.abort()

    def quarantined(self) -> list[QuarantineRecord]:
        """Every quarantine record of every pool."""
        return [r for pool in self.pools.values() for r in pool.quarantined()]

    def report(self, *, complete: bool = False) -> QuarantineReport:
        return QuarantineReport(run_id=self.run_id, complete=complete, entries=self.quarantined())

    def statistics(self) -> ResourcesStatistics:
        pools = tuple(p.statistics() for p in self.pools.values())
        return ResourcesStatistics(
            borrowed=sum(p.borrowed for p in pools),
            live=sum(p.live for p in pools),
            released=sum(p.released for p in pools),
            quarantined=sum(p.quarantined for p in pools),
            may_exist=sum(p.may_exist for p in pools),
            pools=pools,
        )

    def _report_write(self, *, final: bool = False) -> Callable[[], None]:
        """The blocking write of the report as it is now (records taken here, on the loop)."""
        records = self.quarantined()
        return partial(_write_records, self.report_path, self.run_id, records, final)


def _write_records(
    path: Path | None, run_id: str, records: list[QuarantineRecord], final: bool
) -> None:
    """Build and write the report (worker thread), or log what may exist when there is no file."""
    report = QuarantineReport(run_id=run_id, complete=final, entries=records)
    if path is not None:
        write_report(path, report)
    elif final and report.may_exist:
        for entry in report.may_exist:
            log.warning(
                "quarantined %s %s (pool %s): %s",
                entry.kind,
                entry.remote_id,
                entry.pool,
                entry.reason,
            )
