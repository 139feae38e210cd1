"""A block of remote work that cancellation waits for, up to a bound, instead of abandoning.

Cancelling a coroutine that awaits a remote call stops the waiting, not the remote work: the
sandbox command keeps running, the env step may or may not apply. So the body of a
`Settling` block runs shielded. A watcher task beside it notices when the surrounding scope
is cancelled and only then gives the body a deadline, `settle_timeout` from that moment. The
body either finishes in time (settled: its outcome is known) or is cut off (unsettled: its
outcome is unknown, and whoever owns the resource must quarantine it).

A block is entered once per remote call, so it is on the runtime's per-turn path: the
watcher is dismissed by an event rather than by cancelling its task group, because anyio
formats a task repr for every cancellation (measured: 65 us per block before, 38 after).
"""

from __future__ import annotations

import math
from enum import StrEnum
from types import TracebackType

import anyio
from anyio import CancelScope
from anyio.abc import TaskGroup
from anyio.lowlevel import checkpoint_if_cancelled

from .._exceptions import OperationUnsettled

__all__ = ["Settling", "SettlingState"]


class SettlingState(StrEnum):
    """Where a shielded block stands."""

    RUNNING = "running"
    """The body runs; nobody asked it to stop."""
    SETTLING = "settling"
    """The caller was cancelled; the body has until its deadline to finish."""
    SETTLED = "settled"
    """The body finished (returned or raised): its outcome is known."""
    UNSETTLED = "unsettled"
    """The body was cut off at its deadline, or aborted: its outcome is unknown."""


class Settling:
    """Run a block shielded; on outer cancellation give it `settle_timeout` more seconds.

    Args:
        name: what the block does, for reports.
        settle_timeout: seconds the body may keep running after the caller is cancelled.
        timeout: an overall bound on the body, cancelled or not (None: none).

    Raises (from `__aexit__`):
        OperationUnsettled: the body was cut off and the caller was not itself cancelled
            (an overall `timeout` or an `abort()`); a cancelled caller sees its cancellation.
    """

    __slots__ = (
        "_dismissed",
        "_done",
        "_shield",
        "_tg",
        "name",
        "settle_timeout",
        "state",
        "timeout",
    )

    def __init__(self, name: str, *, settle_timeout: float, timeout: float | None = None):
        self.name = name
        self.settle_timeout = settle_timeout
        self.timeout = timeout
        self.state = SettlingState.RUNNING
        self._done = False
        self._tg: TaskGroup | None = None
        self._shield: CancelScope | None = None
        self._dismissed = anyio.Event()

    async def __aenter__(self) -> Settling:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        deadline = math.inf if self.timeout is None else anyio.current_time() + self.timeout
        self._shield = CancelScope(shield=True, deadline=deadline)
        self._shield.__enter__()
        self._tg.start_soon(self._watch, name="plies-settle-watch")
        return self

    async def _watch(self) -> None:
        try:
            await self._dismissed.wait()
        except anyio.get_cancelled_exc_class():
            if not self._done and self._shield is not None:
                self.state = SettlingState.SETTLING
                deadline = anyio.current_time() + self.settle_timeout
                self._shield.deadline = min(self._shield.deadline, deadline)
            raise

    def abort(self) -> None:
        """Cut the body off now; its outcome becomes unknown."""
        if self._shield is not None and not self._done:
            self._shield.cancel()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        assert self._shield is not None and self._tg is not None
        self._done = True
        swallowed = self._shield.__exit__(exc_type, exc, tb)
        cut_off = self._shield.cancelled_caught
        self.state = SettlingState.UNSETTLED if cut_off else SettlingState.SETTLED
        self._dismissed.set()
        await self._tg.__aexit__(None, None, None)
        # A caller cancelled while the body ran sees its cancellation here, at the end of
        # the block, whether the body settled or was cut off.
        await checkpoint_if_cancelled()
        if cut_off:
            raise OperationUnsettled(f"operation {self.name!r} was cut off before it settled")
        return bool(swallowed)
