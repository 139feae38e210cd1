"""`DurableWriter`: the one task that does a resources scope's durable writes, off the loop.

Why: an fsync takes milliseconds, and the quarantine report is rewritten whole (temp file,
fsync, rename, fsync of the directory). Done on the event loop, a burst of either stalls every
episode of the process: 1,024 quarantines, one rewrite each, held the loop for seconds, inside
the grace window of a SIGTERM. Here the writes run in a worker thread, one at a time, under
three rules:

- groups go out in batches: every group queued since the last write, each as one whole line,
  then one fsync per sink (a group commit). A batch's callbacks run on the loop only after
  its fsync, so a group is on disk before the driver hands it out;
- a change of the report only marks it stale. The writer rewrites it from a snapshot taken
  when it gets to it, so a burst of changes costs one or two rewrites, not one each;
- a stale report is rewritten before the next batch of groups, so a group is handed out only
  after the report lists every lease quarantined before that group settled.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import anyio
from anyio import CancelScope
from anyio.abc import TaskStatus

from ..trajectory import Group
from ._sink import JsonlSink

__all__ = ["DurableWriter"]

log = logging.getLogger("plies.runtime")

Written = Callable[[BaseException | None], None]
"""Called on the loop once a group's batch is on disk (None) or failed (the error)."""


@dataclass(frozen=True, slots=True)
class _Append:
    sink: JsonlSink | None
    """None: nothing to write; the group only waits for a stale report."""
    group: Group
    done: Written


def _append_batch(batch: list[_Append]) -> None:
    """Write every group of `batch` to its sink, then fsync each sink once (worker thread).

    All or nothing: when a write or an fsync fails, every line of the batch is cut off again,
    since each of its groups is then reported failed and must not be on disk either.
    """
    sinks: dict[int, tuple[JsonlSink, tuple[int, int]]] = {}
    try:
        for job in batch:
            if job.sink is not None:
                if id(job.sink) not in sinks:
                    sinks[id(job.sink)] = (job.sink, job.sink.mark())
                job.sink.write(job.group)
        for sink, _ in sinks.values():
            sink.sync()
    except Exception:
        for sink, mark in sinks.values():
            with contextlib.suppress(OSError):  # the write's own error is the one to raise
                sink.rollback(mark)
        raise


class DurableWriter:
    """Runs durable writes in a worker thread, in order, one at a time.

    Args:
        snapshot: called on the loop when the report is stale; returns the blocking write of
            the report as it is now, which runs in the worker thread. None: no report.
    """

    def __init__(self, snapshot: Callable[[], Callable[[], None]] | None = None):
        self._snapshot = snapshot
        self._appends: list[_Append] = []
        self._stale = False
        self._busy = False
        self._reporting = False
        self._wake = anyio.Event()
        self._idle = anyio.Event()
        self._scope: CancelScope | None = None
        self.report_error: BaseException | None = None
        """Why the last report rewrite failed (None once one succeeds); the next change retries."""

    @property
    def pending(self) -> bool:
        """A write is queued or running."""
        return self._busy or self._stale or bool(self._appends)

    @property
    def report_pending(self) -> bool:
        """The report is stale or being rewritten: a group settling now must wait for it."""
        return self._stale or self._reporting

    def append(self, sink: JsonlSink | None, group: Group, done: Written) -> None:
        """Queue `group` for `sink`; `done` runs on the loop once it is fsynced (or failed).

        With no sink, `done` runs once a report that was pending has been rewritten.
        """
        self._appends.append(_Append(sink, group, done))
        self._wake.set()

    def report_changed(self) -> None:
        """Mark the report stale; it is rewritten once the writer gets to it."""
        if self._snapshot is not None:
            self._stale = True
            self._wake.set()

    async def wait_idle(self) -> None:
        """Wait until nothing is queued or running."""
        while self.pending:
            idle = self._idle
            await idle.wait()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The writer task: take what is queued, write it, repeat, until `stop()`.

        It is shielded: cancelling the scope around a run (a third Ctrl-C) must not stop the
        writes that the driver's exit and the final report still wait for.
        """
        with CancelScope(shield=True) as self._scope:
            task_status.started()
            await self._serve()

    def stop(self) -> None:
        """End `run` (what is being written is finished first: a thread is not interrupted)."""
        if self._scope is not None:
            self._scope.cancel()

    async def _serve(self) -> None:
        while True:
            if not self.pending:
                self._idle.set()
                self._idle = anyio.Event()
                await self._wake.wait()
                self._wake = anyio.Event()
                continue
            self._busy = True
            try:
                if self._stale:
                    await self._rewrite_report()
                if self._appends:
                    batch, self._appends = self._appends, []
                    await self._write_batch(batch)
            finally:
                self._busy = False

    async def _rewrite_report(self) -> None:
        assert self._snapshot is not None
        self._stale = False
        self._reporting = True
        write = self._snapshot()
        try:
            await anyio.to_thread.run_sync(write)
        except Exception as exc:
            # Not fatal to the run: the records stay in memory, the next change (or the final
            # report at scope exit, which raises) writes them again.
            self.report_error = exc
            log.error("could not rewrite the quarantine report: %r", exc)
        else:
            self.report_error = None
        finally:
            self._reporting = False

    async def _write_batch(self, batch: list[_Append]) -> None:
        error: BaseException | None = None
        try:
            if any(job.sink is not None for job in batch):
                await anyio.to_thread.run_sync(_append_batch, batch)
        except Exception as exc:  # handed to each group's owner, which raises it
            error = exc
        for job in batch:
            job.done(error)
