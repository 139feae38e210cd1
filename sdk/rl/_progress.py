"""The run's one live display: a bar with elapsed time and ETA for each phase as it runs.

On a terminal the phases in progress are drawn by one rich `Progress` (the warm start, an
evaluation, the GRPO steps; an evaluation during GRPO gets a row of its own), and lines
printed meanwhile scroll above it. In a pipe or a log file nothing is drawn: a phase prints
one line each tenth of the way instead, with the same figures, so logs stay readable.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import TracebackType

import anyio
from anyio.abc import TaskGroup
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from plies.runtime import RolloutDriver

__all__ = ["Phase", "RunProgress"]

SPEED_WINDOW_S = 600.0
"""The ETA's window: long enough to span a few GRPO steps, which take tens of seconds each."""

DRIVER_REFRESH_S = 0.5
"""How often a phase that samples shows its driver's episodes and turns per second."""


class Phase:
    """One phase's row: advance it as units finish; `status` is the text beside the bar."""

    def __init__(self, owner: RunProgress, task: TaskID, name: str, total: int):
        self._owner = owner
        self._task = task
        self.name = name
        self.total = total
        self._tenth = self._tenths()

    @property
    def completed(self) -> int:
        return int(self._owner.progress.tasks[self._index()].completed)

    def _index(self) -> int:
        return next(i for i, t in enumerate(self._owner.progress.tasks) if t.id == self._task)

    def _tenths(self) -> int:
        return 10 * self.completed // self.total if self.total else 10

    def advance(self, units: int = 1, *, status: str | None = None) -> None:
        """Count `units` more done; in a log, print a line at each tenth of the way."""
        fields = {} if status is None else {"status": status}
        self._owner.progress.update(self._task, advance=units, **fields)
        tenth = self._tenths()
        if not self._owner.live and tenth > self._tenth:
            self._owner.console.print(self.line())
        self._tenth = tenth

    def status(self, text: str) -> None:
        self._owner.progress.update(self._task, status=text)

    def line(self) -> str:
        """The row as one line of text: done/total, elapsed, ETA, status."""
        task = self._owner.progress.tasks[self._index()]
        eta = task.time_remaining
        left = "" if eta is None or task.finished else f", ETA {_clock(eta)}"
        status = task.fields.get("status") or ""
        return (
            f"  {escape(self.name)} {int(task.completed)}/{self.total} "
            f"({_clock(task.elapsed or 0.0)}{left}){' ' + status if status else ''}"
        )


class RunProgress:
    """The display of one run, open for the whole run (`with RunProgress(console):`).

    Example:
        with RunProgress(console) as progress, progress.phase("warm start", 120) as phase:
            for step in range(120):
                ...
                phase.advance(status=f"loss {loss:.3f}")
    """

    def __init__(self, console: Console):
        self.console = console
        self.live = console.is_terminal
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=30),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            console=console,
            disable=not self.live,
            transient=True,
            speed_estimate_period=SPEED_WINDOW_S,
        )

    def __enter__(self) -> RunProgress:
        self.progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.progress.stop()

    @contextmanager
    def phase(self, name: str, total: int, *, completed: int = 0) -> Iterator[Phase]:
        """A row for `name`, `completed` of `total` units already done (a resumed phase)."""
        task = self.progress.add_task(escape(name), total=total, completed=completed, status="")
        try:
            yield Phase(self, task, name, total)
        finally:
            self.progress.remove_task(task)

    def sampling(self, phase: Phase, driver: RolloutDriver) -> _Sampling:
        """`async with`: show `driver`'s episodes running and turns per second by `phase`."""
        return _Sampling(self, phase, driver)


class _Sampling:
    """The driver's figures beside a phase, refreshed while the block runs (terminal only).

    Its task group is entered and left by hand, with no exception passed in, as `LiveProgress`
    does: an error of the block (`Interrupted`) must reach the caller as itself, not wrapped
    in an exception group.
    """

    def __init__(self, owner: RunProgress, phase: Phase, driver: RolloutDriver):
        self._owner = owner
        self._phase = phase
        self._driver = driver
        self._tg: TaskGroup | None = None

    async def __aenter__(self) -> None:
        if self._owner.live:  # a log gets the phase's own lines; a rate there is noise
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
            self._tg.start_soon(self._watch)

    async def _watch(self) -> None:
        turns, t = self._driver.statistics().turns, anyio.current_time()
        while True:
            await anyio.sleep(DRIVER_REFRESH_S)
            stats, now = self._driver.statistics(), anyio.current_time()
            rate = (stats.turns - turns) / max(now - t, 1e-9)
            turns, t = stats.turns, now
            self._phase.status(f"{stats.running} episodes running, {rate:.0f} turns/s")

    async def __aexit__(self, *exc_info: object) -> None:
        if self._tg is not None:
            tg, self._tg = self._tg, None
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)


def _clock(seconds: float) -> str:
    """`1:02:03` / `2:03`: short enough for a status line."""
    text = str(timedelta(seconds=round(seconds)))
    return text[2:] if text.startswith("0:") else text
