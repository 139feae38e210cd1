"""A block of remote work that cancellation waits for, up to a bound, instead of abandoning.

Cancelling a coroutine that awaits a remote call stops the waiting, not the remote work: the
sandbox command keeps running, the env step may or may not apply. So the body of a
`Settling` block runs shielded. A watcher task beside it notices when the surrounding scope
is cancelled and only then gives the body a deadline, `settle_timeout` from that moment. The
body either finishes in time (settled: its outcome is known) or is cut off (unsettled: its
outcome is unknown, and whoever owns the resource must quarantine it).

A block is entered once per remote call, so it is on the runtime's per-turn path. Spawning
a watcher (a task group, a task, an event) costs several times what the shield does, so a
loop that enters its blocks one after another in one scope shares one watcher, a
`SettleWatch`, instead of starting one per block (docs/scaling.md has the per-turn
figures). A block's own watcher is dismissed by an event rather than by cancelling its task
group, because anyio formats a task repr for every cancellation.
"""

from __future__ import annotations

import math
from enum import StrEnum
from types import TracebackType

import anyio
from anyio import CancelScope
from anyio.abc import TaskGroup
from anyio.lowlevel import checkpoint_if_cancelled

from .._exceptions import OperationUnsettled, UsageError

__all__ = ["SettleWatch", "Settling", "SettlingState"]


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


class SettleWatch:
    """One watcher for the `Settling` blocks a loop enters one after another in one scope.

    Enter it in the scope whose cancellation the blocks should settle on, and enter each
    block (`Settling(..., watch=w)`, `lease.operation(..., watch=w)`) directly in that scope:
    a cancel scope opened between the watch and a block is invisible to the watch, so such a
    block needs a watcher of its own (no `watch`). Blocks entered after the cancellation get
    their `settle_timeout` from the moment they are entered, as with a watcher of their own.

    Raises (from a block): UsageError when the watch is not entered.
    """

    __slots__ = ("_active", "_dismissed", "_open", "_tg", "cancelled")

    def __init__(self) -> None:
        self.cancelled = False
        """The watched scope was cancelled: every block from now on is settling."""
        self._active: set[Settling] = set()
        self._dismissed = anyio.Event()
        self._tg: TaskGroup | None = None
        self._open = False

    async def __aenter__(self) -> SettleWatch:
        if self._tg is not None:
            raise UsageError("a SettleWatch is entered once")
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._watch, name="plies-settle-watch")
        self._open = True
        return self

    async def _watch(self) -> None:
        try:
            await self._dismissed.wait()
        except anyio.get_cancelled_exc_class():
            self.cancelled = True
            for block in self._active:
                block._settle_from_now()
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._tg is not None
        self._open = False
        self._dismissed.set()
        # The body's exception, cancellation included, goes on as raised, never grouped.
        await self._tg.__aexit__(None, None, None)

    def _join(self, block: Settling) -> None:
        if not self._open:
            raise UsageError(f"operation {block.name!r} names a SettleWatch that is not entered")
        self._active.add(block)
        if self.cancelled:
            block._settle_from_now()


class Settling:
    """Run a block shielded; on outer cancellation give it `settle_timeout` more seconds.

    Args:
        name: what the block does, for reports.
        settle_timeout: seconds the body may keep running after the caller is cancelled.
        timeout: an overall bound on the body, cancelled or not (None: none).
        watch: a shared watcher to use instead of starting one (see `SettleWatch`).

    Raises (from `__aexit__`):
        OperationUnsettled: the body was cut off and the caller was not itself cancelled
            (an overall `timeout` or an `abort()`); a cancelled caller sees its cancellation.
    """

    __slots__ = (
        "_done",
        "_own_watch",
        "_shield",
        "_watch",
        "name",
        "settle_timeout",
        "state",
        "timeout",
    )

    def __init__(
        self,
        name: str,
        *,
        settle_timeout: float,
        timeout: float | None = None,
        watch: SettleWatch | None = None,
    ):
        self.name = name
        self.settle_timeout = settle_timeout
        self.timeout = timeout
        self.state = SettlingState.RUNNING
        self._done = False
        self._shield: CancelScope | None = None
        self._watch = watch
        self._own_watch = watch is None

    async def __aenter__(self) -> Settling:
        deadline = math.inf if self.timeout is None else anyio.current_time() + self.timeout
        self._shield = CancelScope(shield=True, deadline=deadline)
        if self._own_watch:  # a watch of the block's own: the caller's scope is its scope
            self._watch = SettleWatch()
            await self._watch.__aenter__()
        assert self._watch is not None
        self._watch._join(self)
        self._shield.__enter__()
        return self

    def _settle_from_now(self) -> None:
        """The caller was cancelled: the body has `settle_timeout` from now."""
        if not self._done and self._shield is not None:
            self.state = SettlingState.SETTLING
            deadline = anyio.current_time() + self.settle_timeout
            self._shield.deadline = min(self._shield.deadline, deadline)

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
        assert self._shield is not None
        self._done = True
        swallowed = self._shield.__exit__(exc_type, exc, tb)
        cut_off = self._shield.cancelled_caught
        self.state = SettlingState.UNSETTLED if cut_off else SettlingState.SETTLED
        assert self._watch is not None
        self._watch._active.discard(self)
        if self._own_watch:
            await self._watch.__aexit__(None, None, None)
        # A caller cancelled while the body ran sees its cancellation here, at the end of
        # the block, whether the body settled or was cut off.
        await checkpoint_if_cancelled()
        if cut_off:
            raise OperationUnsettled(f"operation {self.name!r} was cut off before it settled")
        return bool(swallowed)
