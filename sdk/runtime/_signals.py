"""Ctrl-C in three steps, for scripts that run rollouts.

`run(main)` runs `main(interrupts)` under anyio and turns SIGINT into steps applied to the
drivers attached with `interrupts.attach(driver)`:

1. stop admitting and drain: episodes in flight finish, their groups are written;
2. cancel episodes in flight: remote operations get `settle_timeout` to settle, otherwise
   their leases are quarantined;
3. abort now: every operation is cut off, what is left is quarantined, and `main` is
   cancelled; `RolloutResources` still writes its quarantine report on the way out.

SIGTERM, what schedulers and container runtimes send before a SIGKILL, goes straight to
step 2 (or one step past where the run is): a grace period is too short to drain, but long
enough for operations to settle and for the report to be written.

Each step prints one line on stderr. An interrupted run exits with 130 (143 after a
SIGTERM) and no traceback. `run` returns once the worker threads its loop started have
finished (a signal meanwhile is counted, not raised). After a run that ended on its own the
handlers it found are back, so a two-phase script can be interrupted again; after an
interrupted one a signal stays counted as late until the process exits: the script is
finishing what Ctrl-C asked for, and a second Ctrl-C sent a moment after the first must not
turn `raise SystemExit(run(main))` into a KeyboardInterrupt traceback. Once the process
starts to exit, both signals are ignored, since a signal then has nothing left to stop.

While `main` runs, what was loaded before is frozen out of the cyclic collector's scans and
young objects are collected less often (`long_run_collector`): the collector's full scans of
a heap holding transformers were a rollout loop's worst stalls.
"""

from __future__ import annotations

import atexit
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import IO, Any, Protocol, TypeVar

import anyio
from anyio import CancelScope

from ._admission import DriverState, DriverStatistics
from ._collector import long_run_collector

__all__ = ["EXIT_INTERRUPTED", "EXIT_TERMINATED", "Interrupts", "run"]

EXIT_INTERRUPTED = 130
"""128 + SIGINT, what shells report for a run stopped by Ctrl-C."""
EXIT_TERMINATED = 143
"""128 + SIGTERM, for a run stopped by SIGTERM."""


class Interruptible(Protocol):
    """What Ctrl-C steps act on: `RolloutDriver`, or `ShardedDriver` fanning out to shards."""

    @property
    def state(self) -> DriverState: ...
    def statistics(self) -> DriverStatistics: ...
    def close_admission(self) -> None: ...
    def cancel(self) -> None: ...
    def abort(self) -> None: ...


D = TypeVar("D", bound=Interruptible)


class Interrupts:
    """Counts interrupts and applies each step to the attached drivers.

    Attributes:
        count: the step reached: 0 none, 1 draining, 2 cancelling, 3 or more aborting.
        terminated: a SIGTERM arrived.
    """

    def __init__(self, *, stream: IO[str] | None = None):
        self.count = 0
        self.terminated = False
        self._stream = stream
        self._drivers: list[Interruptible] = []
        self._main: CancelScope | None = None

    def attach(self, driver: D) -> D:
        """Apply interrupts to `driver`, including any received before it was attached."""
        self._drivers.append(driver)
        _escalate(driver, self.count)
        return driver

    def _say(self, line: str) -> None:
        stream = self._stream or sys.stderr
        print(f"plies: {line}", file=stream, flush=True)

    def interrupt(self) -> None:
        """Take the next step, as if SIGINT had arrived."""
        self._step(self.count + 1, "second interrupt")

    def terminate(self) -> None:
        """Cancel the episodes in flight (step 2, or the step after the current one)."""
        self.terminated = True
        self._step(max(self.count + 1, 2), "terminated")

    def _step(self, step: int, cancel_cause: str) -> None:
        self.count = step
        drivers = [d for d in self._drivers if d.state is not DriverState.CLOSED]
        running = sum(d.statistics().running for d in drivers)
        if not drivers and self._main is not None:
            self._say("interrupted; stopping")
            self._main.cancel()
            return
        if step > 3:
            self._say("already aborting; waiting for the quarantine report to be written")
            return
        self._say(_step_line(step, running, cancel_cause))
        for driver in drivers:
            _escalate(driver, step)
        if step == 3 and self._main is not None:
            self._main.cancel()


def _escalate(driver: Interruptible, step: int) -> None:
    """Bring one driver to `step`: one place, so a late-attached driver catches up exactly."""
    if step >= 3:
        driver.abort()
    elif step == 2:
        driver.cancel()
    elif step == 1:
        driver.close_admission()


def _step_line(step: int, running: int, cancel_cause: str) -> str:
    """What a step does, to how many episodes, and what the next Ctrl-C would do."""
    if step == 1:
        return (
            f"interrupt: admission stopped; draining {running} running episodes "
            "(Ctrl-C again to cancel them)"
        )
    if step == 2:
        return (
            f"{cancel_cause}: cancelling {running} episodes; remote operations may "
            "settle, or are quarantined (Ctrl-C again to abort)"
        )
    return "third interrupt: aborting now; the quarantine report lists what is left"


def run(
    main: Callable[[Interrupts], Awaitable[Any]],
    *,
    backend: str = "asyncio",
    stream: IO[str] | None = None,
) -> int:
    """Run `main(interrupts)` with three-step Ctrl-C handling; return the exit code.

    Returns:
        0 when `main` returned without an interrupt, 143 after a SIGTERM, else 130 after
        any interrupt.

    Example::

        async def main(interrupts):
            async with RolloutResources(...) as res, RolloutDriver(res, ep, policy=ref) as d:
                interrupts.attach(d)
                ...

        if __name__ == "__main__":
            raise SystemExit(plies.runtime.run(main))
    """
    interrupts = Interrupts(stream=stream)
    previous = {signum: signal.getsignal(signum) for signum in _SIGNALS}
    _ignore_signals_at_exit()

    async def wrapper() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(_started, interrupts)
            with CancelScope() as scope:
                interrupts._main = scope
                try:
                    await main(interrupts)
                except Exception as exc:
                    if not interrupts.count:
                        raise
                    interrupts._say(f"stopped with {type(exc).__name__}: {exc}")
            tg.cancel_scope.cancel()

    threads = set(threading.enumerate())
    try:
        with long_run_collector():
            anyio.run(wrapper, backend=backend)
    except KeyboardInterrupt:
        # SIGINT while the loop was starting, before the receiver was installed.
        interrupts.count += 1
        interrupts._say("interrupted while starting")
    finally:
        _install_late_handlers(interrupts)
        _join_new_threads(threads)
        if not interrupts.count:
            for signum, handler in previous.items():
                # None: installed outside Python; the default is the closest we can put back.
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)
    if interrupts.terminated:
        return EXIT_TERMINATED
    return EXIT_INTERRUPTED if interrupts.count else 0


_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_exit_hooked = False


def _ignore_signals_at_exit() -> None:
    """From the interpreter's exit on, ignore both signals (registered once per process).

    Interpreter shutdown resets Python-level handlers to the default, which would let a
    signal sent while a script exits with 130 kill it with -SIGINT instead.
    """
    global _exit_hooked
    if not _exit_hooked:
        _exit_hooked = True
        atexit.register(_ignore_signals)


def _ignore_signals() -> None:
    for signum in _SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def _late_signal(interrupts: Interrupts, signum: int) -> None:
    interrupts.count += 1
    interrupts.terminated |= signum == signal.SIGTERM
    interrupts._say(f"{signal.Signals(signum).name} received while finishing; nothing left to stop")


async def _started(interrupts: Interrupts, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
    try:
        with anyio.open_signal_receiver(*_SIGNALS) as signals:
            task_status.started()
            async for signum in signals:
                if signum == signal.SIGTERM:
                    interrupts.terminate()
                else:
                    interrupts.interrupt()
    except KeyboardInterrupt:
        # A SIGINT between the receiver putting Python's own handler back (it removes one
        # signal's handler after the other) and the late handlers below: counted, not raised
        # out of the loop with a traceback.
        _late_signal(interrupts, signal.SIGINT)
    finally:
        # Closing the receiver restores the default handlers (KeyboardInterrupt anywhere,
        # or death by SIGTERM); from here until `run` returns a signal has nothing to stop.
        _install_late_handlers(interrupts)


def _install_late_handlers(interrupts: Interrupts) -> None:
    """From here on a signal is counted as late (`_late_signal`): it has nothing to stop."""
    for signum in _SIGNALS:
        signal.signal(signum, lambda n, _: _late_signal(interrupts, n))


def _join_new_threads(before: set[threading.Thread]) -> None:
    """Wait for the non-daemon threads started during the run (the loop's worker threads).

    The interpreter joins them at exit before any `atexit` hook can ignore signals, so a
    signal while one winds down would print a KeyboardInterrupt traceback from `threading`.
    Joined here, under the late handlers, it is counted like any other late signal.
    """
    for thread in threading.enumerate():
        if thread not in before and not thread.daemon:
            thread.join()
