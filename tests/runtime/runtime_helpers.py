"""Real local processes as pooled resources, for the runtime tests and the signal script."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
from anyio.abc import Process

from plies.runtime import process_remote_id

OP_SERVER = Path(__file__).with_name("op_server.py")


class OpProcess:
    """One op-server process in its own process group: a resource with a remote id."""

    remote_kind = "process"

    def __init__(self, process: Process, url: str):
        self.process = process
        self.url = url
        self.pid = process.pid
        self.remote_id = process_remote_id(process.pid)

    async def aclose(self) -> None:
        """Terminate the process and wait for it: a teardown that succeeds."""
        if self.process.returncode is None:
            self.process.terminate()
        await self.process.wait()
        await self.process.aclose()


async def spawn_op_server(on_spawn: Callable[[int], None] | None = None) -> OpProcess:
    """Start `op_server.py` and wait for its ready line.

    A factory must not leak what it started when it fails or is cancelled half way: the
    process is killed (shielded) unless it was handed out.
    """
    process = await anyio.open_process(
        [sys.executable, str(OP_SERVER)],
        stdin=None,
        stderr=None,
        start_new_session=True,
    )
    if on_spawn is not None:
        on_spawn(process.pid)
    handed_out = False
    try:
        buf = b""
        with anyio.fail_after(20):
            while not buf.endswith(b"\n"):
                assert process.stdout is not None
                buf += await process.stdout.receive()
        info = json.loads(buf)
        handed_out = True
        return OpProcess(process, info["url"])
    finally:
        if not handed_out:
            with anyio.CancelScope(shield=True):
                process.kill()
                await process.aclose()


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


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
