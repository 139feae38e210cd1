"""A test script run as a real child process that reports on stdout, one JSON event a line.

The signal, chaos and Ray tests each drive such a script and read its events while it runs
(to know when to press Ctrl-C, or what it had done before a fault), so the reading lives here
once: a reader thread for stdout and one for stderr, so that neither pipe fills up and stalls
the child. Each test subclasses `EventScript` for its script's arguments and events.

The writing lives here too, for the scripts (they put this folder on `sys.path`): `emit` one
event, `lease_counts` for their `stats` event, `report_groups`, the body of every signal
script's open driver, `drive`, a `RolloutDriver` run from its resources to its `stats`, and
`drive_harness`, the same for a harness's episodes with its files in the script's run dir.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from plies.runtime import JsonlSink, RolloutDriver, RolloutResources

if TYPE_CHECKING:
    from plies.harness import Harness
    from plies.runtime import Pool

Event = dict[str, Any]


def emit(event: str, **fields: Any) -> None:
    """Print one event for the test reading this script: a JSON line, flushed at once."""
    print(json.dumps({"event": event, **fields}), flush=True)


def lease_counts(statistics: Any) -> dict[str, int]:
    """The lease accounting of a pool's, resources' or driver's lease statistics, as the
    tests check it (`borrowed == released + quarantined` once nothing is `live`)."""
    return {
        "borrowed": statistics.borrowed,
        "released": statistics.released,
        "quarantined": statistics.quarantined,
        "live": statistics.live,
    }


async def report_groups(
    driver: Any, interrupts: Any, admit: Callable[[Any], Awaitable[None]], **ready: Any
) -> None:
    """Run an open driver as the signal tests expect: Ctrl-C wired to it, a `ready` event
    (with `ready`'s fields), `admit(driver)` alongside, and a `group` event for each group
    once the sink wrote it, until the driver has no more."""
    interrupts.attach(driver)
    emit("ready", **ready)
    async with anyio.create_task_group() as tg:
        tg.start_soon(admit, driver)
        async for group in driver.groups():
            emit("group", id=group.id, task_id=group.task_id)


async def drive(
    resources: RolloutResources,
    play: Callable[[Any], Awaitable[Any]],
    interrupts: Any,
    admit: Callable[[Any], Awaitable[None]],
    *,
    sink_path: Path,
    policy: Any,
    ready: dict[str, Any] | None = None,
    more_stats: Callable[[], dict[str, Any]] | None = None,
    **options: Any,
) -> None:
    """Open `resources`, a `JsonlSink` at `sink_path` and a `RolloutDriver` (`options` are
    its own) playing `play`, and `report_groups` on it; whatever ends the run, a `stats`
    event with the resources' `lease_counts` and `more_stats()`."""
    try:
        async with resources:
            with JsonlSink(sink_path) as sink:
                async with RolloutDriver(
                    resources, play, policy=policy, sink=sink, **options
                ) as driver:
                    await report_groups(driver, interrupts, admit, **(ready or {}))
    finally:
        extra = more_stats() if more_stats is not None else {}
        emit("stats", **extra, **lease_counts(resources.statistics()))


async def drive_harness(
    harness: Harness,
    pools: Sequence[Pool[Any]],
    run_dir: Path,
    interrupts: Any,
    admit: Callable[[Any], Awaitable[None]],
    **options: Any,
) -> None:
    """`drive` `harness.play` on resources that sample from `harness.sampler` and lend
    `pools`, with the run's files where the signal tests read them: the quarantine report at
    RUN_DIR/quarantine.json (what `plies reap` is given) and the groups at
    RUN_DIR/groups.jsonl. `options` are `drive`'s own."""
    resources = RolloutResources(
        sampler=harness.sampler, pools=pools, report_path=run_dir / "quarantine.json"
    )
    await drive(
        resources, harness.play, interrupts, admit, sink_path=run_dir / "groups.jsonl", **options
    )


class EventScript:
    """`argv` running as a child; its stdout events in `events` (lines that are not JSON in
    `noise`), its stderr lines in `stderr`, `ready` set by its `ready` event."""

    def __init__(self, argv: Sequence[str], **popen: Any):
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
        )
        self.events: list[Event] = []
        self.noise: list[str] = []
        self.stderr: list[str] = []
        self.ready = threading.Event()
        self._changed = threading.Condition()
        self._readers = [
            threading.Thread(target=self._read_events, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read_events(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                self.noise.append(line)
                continue
            with self._changed:
                self.events.append(event)
                self._changed.notify_all()
            if event["event"] == "ready":
                self.ready.set()
        with self._changed:
            self._changed.notify_all()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        self.stderr.extend(self.proc.stderr)

    def wait_for(self, match: Callable[[Event], bool], timeout: float) -> Event | None:
        """The first event that matches, waiting up to `timeout`; None if the run ended first."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._changed:
            while True:
                for event in self.events[seen:]:
                    if match(event):
                        return event
                seen = len(self.events)
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._readers[0].is_alive()):
                    return None
                self._changed.wait(min(left, 0.2))

    def all(self, name: str) -> list[Event]:
        """Every event called `name`, in the order printed."""
        return [e for e in self.events if e["event"] == name]

    def finish(self, timeout: float) -> tuple[int, str]:
        """Wait up to `timeout` for the exit; the exit code and the whole stderr.

        A script still running then is killed (`kill`) and says so at the end of its stderr,
        so the caller's check of the exit code fails with the reason in its message.
        """
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
            self.stderr.append(f"[test] the script did not exit within {timeout:g}s; killed\n")
        for reader in self._readers:
            reader.join(timeout=10)
        return self.proc.returncode, self.err

    def kill(self) -> None:
        """Stop a script that outlived its `finish` timeout."""
        self.proc.kill()

    @property
    def err(self) -> str:
        return "".join(self.stderr)
