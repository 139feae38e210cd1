"""A live terminal display of a driver: admitted, running, settled, quarantined, turns/s.

It draws only on a terminal; in a pipe or a log file it does nothing, so logs stay clean.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import TaskGroup

from ._admission import DriverStatistics
from ._driver import RolloutDriver

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["LiveProgress"]

DEFAULT_REFRESH_S = 0.5


def render_line(stats: DriverStatistics, turns_per_s: float) -> str:
    """One status line; what the live display shows, also handy for logs."""
    settled = " ".join(f"{status.value}={n}" for status, n in stats.settled.items() if n)
    return (
        f"admitted {stats.admitted} | running {stats.running} | settled {stats.settled_total}"
        f"{f' ({settled})' if settled else ''} | quarantined {stats.quarantined} | "
        f"groups {stats.groups_complete}/{stats.admitted_groups} | {turns_per_s:.1f} turns/s"
    )


class LiveProgress:
    """Show a driver's progress while the block runs.

    Args:
        driver: the driver to watch.
        console: a rich console; default: one on stderr.
        refresh_s: seconds between updates; turns/s is measured over that window.

    Example::

        async with RolloutDriver(...) as driver, LiveProgress(driver):
            ...
    """

    def __init__(
        self,
        driver: RolloutDriver,
        *,
        console: Console | None = None,
        refresh_s: float = DEFAULT_REFRESH_S,
    ):
        from rich.console import Console

        self.driver = driver
        self.console = console or Console(stderr=True)
        self.refresh_s = refresh_s
        self._tg: TaskGroup | None = None
        self._live: Any = None

    @property
    def enabled(self) -> bool:
        """Drawing happens only on a terminal."""
        return self.console.is_terminal

    async def __aenter__(self) -> LiveProgress:
        if self.enabled:
            from rich.live import Live

            self._live = Live(console=self.console, transient=False, auto_refresh=False)
            self._live.start()
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
            self._tg.start_soon(self._update)
        return self

    async def _update(self) -> None:
        last_turns, last_t = self.driver.statistics().turns, anyio.current_time()
        while True:
            await anyio.sleep(self.refresh_s)
            stats = self.driver.statistics()
            now = anyio.current_time()
            rate = (stats.turns - last_turns) / max(now - last_t, 1e-9)
            last_turns, last_t = stats.turns, now
            self._live.update(render_line(stats, rate), refresh=True)

    async def __aexit__(self, *exc_info: object) -> None:
        if self._tg is not None:
            tg, self._tg = self._tg, None
            tg.cancel_scope.cancel()
            try:
                await tg.__aexit__(None, None, None)
            finally:
                self._live.stop()
