"""One call of a run, as its log records it: opened, timed, and said to be resumable when
Ctrl-C stopped it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
from rich.console import Console

from plies.runtime import Interrupts

from ._grpo import Interrupted
from ._runlog import RunLog

__all__ = ["RESUME_HINT", "run_session"]

RESUME_HINT = "[yellow]interrupted[/]: run the same command again to resume"
"""What a run says when Ctrl-C stopped it."""


@contextmanager
def run_session(out: Path, console: Console, interrupts: Interrupts) -> Iterator[RunLog]:
    """The run log of `out`, for one call of the run (`train`, or a recipe's job).

    Says so when a crash cut the log's last line off (`RunLog` removed it). On the way out,
    whatever ended the call, appends a `session` record with its seconds (a run's minutes
    are their sum) and closes the log. `Interrupted` (Ctrl-C, groups drained) ends the call
    quietly after saying how to resume; a cancellation that Ctrl-C caused says so too and
    goes on.
    """
    log = RunLog(out / "metrics.jsonl")
    if log.torn_tail is not None:
        console.print(
            f"[yellow]metrics.jsonl[/]: line {log.torn_tail.line} was cut off by a crash "
            "(the event it began did not complete); removed"
        )
    started = time.monotonic()
    try:
        yield log
    except Interrupted:
        console.print(RESUME_HINT)
    except anyio.get_cancelled_exc_class():
        if interrupts.count:  # Ctrl-C with no episodes to drain stops at once
            console.print(RESUME_HINT)
        raise
    finally:
        log.write("session", seconds=time.monotonic() - started)
        log.close()
