"""Real local processes as pooled resources, for the runtime tests and the signal script."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

from anyio.abc import Process

from plies.runtime import process_remote_id
from plies.testing import ServerProcess
from plies.testing._serve import spawn_server, stop_server

OP_SERVER = Path(__file__).with_name("op_server.py")


class OpProcess:
    """One op-server process in its own process group: a resource with a remote id."""

    remote_kind = "process"

    def __init__(self, server: ServerProcess[Process]):
        self.server = server
        self.process = server.process
        self.url = server.url
        self.pid = server.pid
        self.remote_id = process_remote_id(server.pid)

    async def aclose(self) -> None:
        """Terminate the process and wait for it: a teardown that succeeds."""
        await stop_server(self.server)


async def spawn_op_server(on_spawn: Callable[[int], None] | None = None) -> OpProcess:
    """Start `op_server.py` and wait for its ready line.

    A factory must not leak what it started when it fails or is cancelled half way;
    `spawn_server` stops the process (shielded) unless it was handed out. The op server
    writes nothing to stderr, so there is no log to keep.
    """
    argv = [sys.executable, str(OP_SERVER)]
    server = await spawn_server(argv, log=Path(os.devnull), ready_timeout=20, on_spawn=on_spawn)
    return OpProcess(server)


def kill_group(pid: int) -> None:
    """Last-resort cleanup for a test that failed half way."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, 9)


async def take(driver, n: int):
    """The driver's next `n` complete groups, as they come."""
    async for group in driver.groups():
        yield group
        n -= 1
        if not n:
            return
