"""One run of `chaos_loop.py` as a real child process, its stdout events collected as they come."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOOP = Path(__file__).with_name("chaos_loop.py")
Event = dict[str, Any]


class LoopRun:
    """The loop running in `run_dir` with `config`; stdout events in `events`."""

    def __init__(self, run_dir: Path, config: dict[str, Any]):
        self.run_id = run_dir.name
        self.proc = subprocess.Popen(
            [sys.executable, str(LOOP), str(run_dir), json.dumps(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        self.events: list[Event] = []
        self.noise: list[str] = []
        self.stderr: list[str] = []
        self.signals_sent = 0
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

    def finish(self, timeout: float) -> int:
        """Wait for the exit (killing the run past `timeout`); the exit code."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)  # the loop prints where its tasks are
            time.sleep(2)
            self.proc.kill()
            self.proc.wait()
            self.stderr.append(f"[chaos] the run did not exit within {timeout:g}s; killed\n")
        for reader in self._readers:
            reader.join(timeout=10)
        return self.proc.returncode

    def all(self, name: str) -> list[Event]:
        return [e for e in self.events if e["event"] == name]

    def one(self, name: str) -> Event | None:
        found = self.all(name)
        return found[-1] if found else None

    @property
    def err(self) -> str:
        return "".join(self.stderr)
