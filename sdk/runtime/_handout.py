"""How a driver hands out complete groups: on disk first, each once, in completion order.

`RolloutDriver` (one process) and `ShardedDriver` (groups coming back from Ray shards) hand
groups out the same way, so the rule lives here once: a complete group is ready only when
the sink has it fsynced (and the quarantine report lists every lease quarantined before it
settled), `collect` and `groups()` take from one queue, and a sink failure is raised to
whichever caller asks next. `changed` is the one event a driver sets on every change of its
state, so "wait until something happened" is the same `await` everywhere.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Callable
from functools import partial

import anyio

from ..trajectory import Group
from ._sink import JsonlSink
from ._writer import DurableWriter

__all__ = ["Handout"]


class Handout:
    """Complete groups between their last member settling and a caller taking them."""

    def __init__(self, writer: DurableWriter) -> None:
        self.changed = anyio.Event()
        self.handed_out = 0
        self.complete = 0
        """Groups on disk (or ready without a sink), handed out or not."""
        self.writing = 0
        """Complete groups queued to the writer, not yet fsynced."""
        self._writer = writer
        self._ready: deque[Group] = deque()
        self._error: BaseException | None = None

    def wake(self) -> None:
        """Wake every waiter: the driver's state changed."""
        self.changed.set()
        self.changed = anyio.Event()

    async def wait(self) -> None:
        """Wait for the next `wake`."""
        event = self.changed
        await event.wait()

    def add(self, group: Group, sink: JsonlSink | None) -> None:
        """A group whose members have all settled: ready now, or once the writer has it."""
        if sink is None and not self._writer.report_pending:
            self._ready.append(group)
            self.complete += 1
        else:
            self.writing += 1
            self._writer.append(sink, group, partial(self._written, group))

    def _written(self, group: Group, error: BaseException | None) -> None:
        """The writer's word on one group: fsynced (ready) or failed (raised next)."""
        self.writing -= 1
        if error is None:
            self._ready.append(group)
            self.complete += 1
        elif self._error is None:
            self._error = error
        self.wake()

    def raise_error(self) -> None:
        """Raise the sink's failure, once."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def take(self) -> list[Group]:
        """Every ready group, now.

        Raises:
            OSError: writing a group to the sink failed.
        """
        self.raise_error()
        groups = list(self._ready)
        self._ready.clear()
        self.handed_out += len(groups)
        if groups:
            self.wake()
        return groups

    async def stream(self, finished: Callable[[], bool]) -> AsyncIterator[Group]:
        """Yield groups as they become ready until `finished()` says no more will come.

        Raises:
            OSError: writing a group to the sink failed.
        """
        while True:
            self.raise_error()
            while self._ready:
                group = self._ready.popleft()
                self.handed_out += 1
                self.wake()
                yield group
                # Each group is a checkpoint: a burst that one fsync made ready at once would
                # otherwise be handed out without the loop running anything else in between,
                # however long the caller spends on each group.
                await anyio.lowlevel.checkpoint()
            if finished():
                return
            event = self.changed
            self.raise_error()  # it may have failed while the caller held a group
            await event.wait()
