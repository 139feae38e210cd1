"""Start a server process that announces itself with one JSON line; stop it on every path.

Every plies server (`plies serve`, `plies gateway`, the OpenEnv server) binds its port, then
prints one JSON object on stdout, its ready line, with at least `url`. Tests, benchmarks,
examples and recipes all start such processes, so the protocol lives here once: spawn, read
the ready line within a deadline, hand out a `ServerProcess`, and on exit terminate, wait,
then kill. A process that exits or stalls before its ready line is a `PliesError` that names
the command and quotes the end of its log, which is where the reason is.

Two forms of one helper: `serve_process` (anyio, for async code) and `serve_process_sync`
(a reader thread, for pytest fixtures and plain scripts). `spawn_server` and `stop_server`
are the two halves of `serve_process`, for a server whose lifetime a pool owns.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Generic, TypeVar

import anyio
from anyio.abc import Process

from plies import PliesError

__all__ = [
    "ServerProcess",
    "closed_url",
    "free_port",
    "plies_command",
    "serve_process",
    "serve_process_sync",
    "spawn_server",
    "stop_server",
]

OFFLINE_ENV: Mapping[str, str] = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
"""What a child gets unless its environment says otherwise: no model hub, no tokenizer
threads forked behind the server's back."""

DEFAULT_READY_TIMEOUT = 300.0
"""Long enough for a cold start that loads torch and a model on a busy CI machine."""
EXIT_GRACE = 5.0
"""How long a child that closed its stdout early gets to report its exit status."""
STOP_TIMEOUT = 20.0
"""How long a terminated server may take to shut down before it is killed."""
LOG_TAIL = 3000
"""Characters of the log quoted when a server does not get ready."""

ProcessT = TypeVar("ProcessT", Process, subprocess.Popen[bytes])


@dataclass(frozen=True)
class ServerProcess(Generic[ProcessT]):
    """A started server, as its ready line described it.

    `process` is the live child (an `anyio.abc.Process` from `serve_process`, a
    `subprocess.Popen` from `serve_process_sync`), for tests that signal, stop or kill it;
    the helper still reaps it on exit.
    """

    url: str
    """The `url` of the ready line."""
    ready: dict[str, Any]
    """The whole ready line, parsed."""
    log: Path
    """Where the child's stderr goes."""
    process: ProcessT

    @property
    def pid(self) -> int:
        """The child's process id (its session and process group id too)."""
        return self.process.pid


def free_port() -> int:
    """A loopback port nothing listens on now: for a server that must come back at the same
    URL after a restart. Another process may take it before it is bound again."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def closed_url() -> str:
    """A loopback URL nothing listens on: a connection to it is refused, which is how a
    server that is down looks to a client."""
    return f"http://127.0.0.1:{free_port()}"


def plies_command(*args: str) -> list[str]:
    """`python -m plies ARGS` with this interpreter, so a child runs the same install."""
    return [sys.executable, "-m", "plies", *args]


@contextlib.asynccontextmanager
async def serve_process(
    argv: Sequence[str],
    *,
    log: Path,
    env: Mapping[str, str] | None = None,
    ready_timeout: float = DEFAULT_READY_TIMEOUT,
) -> AsyncIterator[ServerProcess[Process]]:
    """Run `argv` until the block ends; yield it once it has printed its ready line.

    The child gets its own session, so a terminal's Ctrl-C reaches only this process, which
    then stops the server in order instead of losing it mid-request. Cleanup is shielded:
    a cancelled caller still terminates (then kills) and reaps the child.

    Args:
        argv: the command; it must print one JSON object with `url` on stdout when ready,
            and nothing else on stdout (later output is never read).
        log: the child's stderr is appended here.
        env: the child's environment (default: this process's), with `OFFLINE_ENV` under it.
        ready_timeout: seconds to wait for the ready line.

    Raises:
        PliesError: the child exited, stalled or printed something else before its ready line.

    Example:
        async with serve_process(plies_command("serve", str(model_dir)), log=log) as server:
            ...  # server.url, server.ready["policy"]
    """
    server = await spawn_server(argv, log=log, env=env, ready_timeout=ready_timeout)
    try:
        yield server
    finally:
        with anyio.CancelScope(shield=True):
            await stop_server(server)


async def spawn_server(
    argv: Sequence[str],
    *,
    log: Path,
    env: Mapping[str, str] | None = None,
    ready_timeout: float = DEFAULT_READY_TIMEOUT,
    on_spawn: Callable[[int], object] | None = None,
) -> ServerProcess[Process]:
    """Start `argv` and wait for its ready line; the caller stops it with `stop_server`.

    `serve_process` without the block, for servers whose lifetime something else owns, such
    as a pool that creates and tears down resources. If waiting fails or is cancelled, the
    child is stopped (shielded) before this returns: nothing started leaks.

    Args:
        on_spawn: called with the child's pid as soon as it exists, for callers that must
            account for every process they start, even one cut off before it is ready.

    The other arguments and the errors are those of `serve_process`.
    """
    with Path(log).open("ab") as err:
        process = await anyio.open_process(list(argv), **_child_options(err, env))
    handed_out = False
    try:
        if on_spawn is not None:
            on_spawn(process.pid)
        line, closed = b"", False
        assert process.stdout is not None
        with anyio.move_on_after(ready_timeout):
            while b"\n" not in line:
                try:
                    line += await process.stdout.receive()
                except anyio.EndOfStream:
                    closed = True
                    break
        if closed:  # most likely exiting: wait a moment for its exit status
            with anyio.move_on_after(EXIT_GRACE):
                await process.wait()
        ready = _parse_ready(line, closed, process.returncode, argv, Path(log), ready_timeout)
        handed_out = True
        return ServerProcess(url=ready["url"], ready=ready, log=Path(log), process=process)
    finally:
        if not handed_out:
            with anyio.CancelScope(shield=True):
                await _stop(process)


async def stop_server(server: ServerProcess[Process]) -> None:
    """Terminate the server, wait up to `STOP_TIMEOUT` s, then kill it; always reap it.

    Safe to call on a server that already exited. Not shielded: a caller that bounds its
    teardown can cancel the wait (the child is then left running, for it to account for).
    """
    await _stop(server.process)


@contextlib.contextmanager
def serve_process_sync(
    argv: Sequence[str],
    *,
    log: Path,
    env: Mapping[str, str] | None = None,
    ready_timeout: float = DEFAULT_READY_TIMEOUT,
) -> Iterator[ServerProcess[subprocess.Popen[bytes]]]:
    """`serve_process` for synchronous code: the same arguments, the same guarantees.

    A daemon thread reads the ready line, so the deadline holds even when the child writes
    half a line and stalls.
    """
    with Path(log).open("ab") as err:
        process = subprocess.Popen(list(argv), **_child_options(err, env))
    assert process.stdout is not None
    lines: list[bytes] = []
    reader = threading.Thread(
        target=lambda out: lines.append(out.readline()), args=(process.stdout,), daemon=True
    )
    try:
        reader.start()
        reader.join(ready_timeout)
        line = lines[0] if lines else b""
        closed = bool(lines) and not line.endswith(b"\n")
        if closed:  # most likely exiting: wait a moment for its exit status
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(EXIT_GRACE)
        ready = _parse_ready(line, closed, process.poll(), argv, Path(log), ready_timeout)
        yield ServerProcess(url=ready["url"], ready=ready, log=Path(log), process=process)
    finally:
        _stop_sync(process)
        if not reader.is_alive():  # else closing would wait for the reader's lock
            process.stdout.close()


def _child_options(err: IO[bytes], env: Mapping[str, str] | None) -> dict[str, Any]:
    """How both forms start a child: stdout piped for the ready line, stderr into the log, its
    own session, and `OFFLINE_ENV` under its environment."""
    return {
        "stdin": subprocess.DEVNULL,
        "stdout": subprocess.PIPE,
        "stderr": err,
        # A server exits when this process is gone (`plies serve` watches for it), so killing
        # a parent outright never leaves its server running in its own session.
        "env": {
            **OFFLINE_ENV,
            **(os.environ if env is None else env),
            "PLIES_PARENT_PID": str(os.getpid()),
        },
        "start_new_session": True,
    }


def _parse_ready(
    line: bytes,
    closed: bool,
    returncode: int | None,
    argv: Sequence[str],
    log: Path,
    ready_timeout: float,
) -> dict[str, Any]:
    """The ready line as a dict with a `url`, or the error that says why there is none.

    Args:
        line: what the child printed, up to and including the first newline.
        closed: whether its stdout ended before a newline.
        returncode: its exit status, if it has exited.
    """
    if b"\n" in line:
        try:
            ready = json.loads(line.split(b"\n", 1)[0])
        except ValueError:
            ready = None
        if isinstance(ready, dict) and isinstance(ready.get("url"), str):
            return ready
        why = f"printed {line[:200]!r} instead of a JSON ready line with a url"
    elif returncode is not None:
        why = f"exited with {_exit_status(returncode)} before its ready line"
    elif closed:
        why = "closed its stdout before its ready line"
    else:
        why = f"printed no ready line within {ready_timeout:g} s"
    command = shlex.join(map(str, argv))
    if len(command) > 300:
        command = command[:300] + " ..."
    tail = log.read_text(errors="replace")[-LOG_TAIL:]
    raise PliesError(f"{command} {why}; the end of {log}:\n{tail}")


def _exit_status(returncode: int) -> str:
    if returncode >= 0:
        return f"code {returncode}"
    try:
        return f"signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"signal {-returncode}"


async def _stop(process: Process) -> None:
    """Terminate, wait up to `STOP_TIMEOUT`, kill; always reap."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        with anyio.move_on_after(STOP_TIMEOUT):
            await process.wait()
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
    await process.aclose()


def _stop_sync(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
