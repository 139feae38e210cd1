"""One run of `chaos_loop.py` as a real child process, its stdout events collected as they come."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from event_script import Event, EventScript

LOOP = Path(__file__).with_name("chaos_loop.py")


class LoopRun(EventScript):
    """The loop running in `run_dir` with `config`; stdout events in `events`."""

    def __init__(self, run_dir: Path, config: dict[str, Any]):
        self.run_id = run_dir.name
        self.signals_sent = 0
        super().__init__(
            [sys.executable, str(LOOP), str(run_dir), json.dumps(config)],
            stdin=subprocess.DEVNULL,
        )

    def kill(self) -> None:
        """Kill the loop, once it has printed where its tasks are (SIGUSR1)."""
        self.proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        self.proc.kill()

    def one(self, name: str) -> Event | None:
        found = self.all(name)
        return found[-1] if found else None
