"""Sandboxes: where an env runs trusted code for one episode, behind one small protocol.

- `SandboxBackend`: makes sandboxes (`create`) and kills one by id (`kill`), even one made by
  another process: that is how `plies reap` tears down what a quarantine report lists.
- `Sandbox`: one sandbox: `run` a command, `read_file` / `write_file` relative to its
  working directory, `kill` it. `id` is its remote id; `kind` names its backend.
- `LocalProcessBackend`: a temporary directory and subprocesses, for tests and laptops.
- `E2BBackend` (in `plies.environments.e2b_backend`): one E2B cloud sandbox per episode.
- `reap_sandbox(kind, id)` (in `plies.environments.reapers`): kill a sandbox by the kind and
  id a report recorded; `sandbox_reapers()` offers it for every kind to `plies reap`.

A command that exits non-zero is not an error: `run` returns its exit code. Failures of the
sandbox itself (it vanished, the network failed, a command timed out) raise `SandboxError`
carrying the sandbox id.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Protocol, runtime_checkable

import anyio
from anyio.abc import ByteReceiveStream, Process

from plies import ConfigError, SandboxError

__all__ = [
    "DEFAULT_ENV_ALLOW",
    "CommandResult",
    "LocalProcessBackend",
    "LocalSandbox",
    "Sandbox",
    "SandboxBackend",
    "marked_pids",
]

DEFAULT_ENV_ALLOW = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")
"""Host environment variables a local sandbox's commands may see; nothing else leaks in."""

_MARKER = ".plies-sandbox.json"
_PREFIX = "plies-sbx-"
_ID_VAR = "PLIES_SANDBOX_ID"


@dataclass(frozen=True, slots=True)
class CommandResult:
    """How a command ended inside a sandbox."""

    exit_code: int
    stdout: str
    stderr: str


@runtime_checkable
class Sandbox(Protocol):
    """One sandbox, owned by one episode."""

    @property
    def id(self) -> str:
        """The remote id: with `kind`, enough to kill it from another process."""
        ...

    @property
    def kind(self) -> str:
        """The backend's name, e.g. 'local-sandbox' or 'e2b'."""
        ...

    async def run(
        self, argv: Sequence[str], *, timeout_s: float, env: Mapping[str, str] | None = None
    ) -> CommandResult:
        """Run a command in the working directory; `SandboxError` if it outlives `timeout_s`."""
        ...

    async def read_file(self, path: str) -> bytes:
        """Read a file, `path` relative to the working directory."""
        ...

    async def write_file(self, path: str, data: bytes | str) -> None:
        """Write a file (creating directories), `path` relative to the working directory."""
        ...

    async def kill(self) -> bool:
        """Kill it, shielded from cancellation. False if it was already gone."""
        ...


@runtime_checkable
class SandboxBackend(Protocol):
    """Makes sandboxes of one kind and kills them by id.

    Example:
        ```python
        backend = LocalProcessBackend()
        sandbox = await backend.create(run_id="run-1", episode_id="ep-7")
        try:
            await sandbox.write_file("hello.py", "print('hi')")
            result = await sandbox.run(["python3", "hello.py"], timeout_s=10)
        finally:
            await sandbox.kill()
        ```
    """

    @property
    def kind(self) -> str: ...

    async def create(self, *, run_id: str, episode_id: str) -> Sandbox:
        """Make one sandbox, labelled with the run and the episode it serves."""
        ...

    async def kill(self, sandbox_id: str) -> bool:
        """Kill a sandbox by id; False if it was already gone."""
        ...


class LocalProcessBackend:
    """Sandboxes as temporary directories on this machine; commands as subprocesses.

    Each command runs in its own process group with the sandbox directory as its working
    directory and `HOME`, and sees only the host variables in `env_allow` plus what the
    caller passes. Killing a sandbox kills the process groups of its running commands and
    removes the directory. This isolates episodes from each other's files, not from the
    host: it is meant for trusted code.

    Args:
        root: where sandbox directories are made; the system temp directory by default.
        env_allow: host environment variables passed through.
    """

    kind = "local-sandbox"

    def __init__(self, root: Path | None = None, *, env_allow: Sequence[str] = DEFAULT_ENV_ALLOW):
        self.root = Path(root) if root is not None else Path(tempfile.gettempdir())
        self.env_allow = tuple(env_allow)

    async def create(self, *, run_id: str, episode_id: str) -> LocalSandbox:
        def make() -> Path:
            self.root.mkdir(parents=True, exist_ok=True)
            path = Path(tempfile.mkdtemp(prefix=_PREFIX, dir=self.root)).resolve()
            (path / "work").mkdir()
            label = {"run_id": run_id, "episode_id": episode_id, "id": str(path)}
            (path / _MARKER).write_text(json.dumps(label))
            return path

        try:
            path = await anyio.to_thread.run_sync(make)
        except OSError as err:
            raise SandboxError(f"could not make a sandbox under {self.root}: {err}") from err
        base_env = {k: os.environ[k] for k in self.env_allow if k in os.environ}
        return self._sandbox(path, base_env)

    def _sandbox(self, path: Path, base_env: Mapping[str, str]) -> LocalSandbox:
        """The sandbox object for a directory just made (a subclass may wrap its commands)."""
        return LocalSandbox(path, base_env)

    async def kill(self, sandbox_id: str) -> bool:
        with anyio.CancelScope(shield=True):
            return await anyio.to_thread.run_sync(_kill_local, sandbox_id)


class LocalSandbox:
    """A sandbox made by `LocalProcessBackend`; its id is the directory's absolute path."""

    kind = LocalProcessBackend.kind

    def __init__(self, path: Path, base_env: Mapping[str, str]):
        self._path = path
        self._work = path / "work"
        self._env = {**base_env, "HOME": str(self._work), "TMPDIR": str(self._work)}
        self._env[_ID_VAR] = str(path)
        self._running: set[int] = set()
        self._killed = False

    @property
    def id(self) -> str:
        return str(self._path)

    @property
    def workdir(self) -> Path:
        return self._work

    async def run(
        self, argv: Sequence[str], *, timeout_s: float, env: Mapping[str, str] | None = None
    ) -> CommandResult:
        self._check_alive()
        if not argv:
            raise ConfigError("run needs a command")
        merged = {**self._env, **(env or {})}
        try:
            process = await anyio.open_process(
                self._command(list(argv), merged),
                cwd=self._work,
                env=merged,
                start_new_session=True,
                stdin=subprocess.DEVNULL,
            )
        except OSError as err:
            raise SandboxError(f"could not start {argv[0]!r}: {err}", sandbox_id=self.id) from err
        self._running.add(process.pid)
        try:
            with anyio.move_on_after(timeout_s) as scope:
                stdout, stderr = await _communicate(process)
            if scope.cancelled_caught:
                raise SandboxError(
                    f"command {list(argv)!r} did not finish in {timeout_s}s and was killed",
                    sandbox_id=self.id,
                )
            code = process.returncode
            return CommandResult(code if code is not None else -1, stdout, stderr)
        finally:
            with anyio.CancelScope(shield=True):
                if process.returncode is None:
                    _killpg(process.pid)
                    with anyio.move_on_after(5):
                        await process.wait()
                await process.aclose()
            self._running.discard(process.pid)

    def _command(self, argv: list[str], env: Mapping[str, str]) -> list[str]:
        """The host command that runs `argv` in this sandbox (a wrapper may enclose it)."""
        return argv

    async def read_file(self, path: str) -> bytes:
        self._check_alive()
        target = self._resolve(path)
        try:
            return await anyio.Path(target).read_bytes()
        except OSError as err:
            raise SandboxError(f"could not read {path!r}: {err}", sandbox_id=self.id) from err

    async def write_file(self, path: str, data: bytes | str) -> None:
        self._check_alive()
        target = anyio.Path(self._resolve(path))
        payload = data.encode() if isinstance(data, str) else data
        try:
            await target.parent.mkdir(parents=True, exist_ok=True)
            await target.write_bytes(payload)
        except OSError as err:
            raise SandboxError(f"could not write {path!r}: {err}", sandbox_id=self.id) from err

    async def kill(self) -> bool:
        with anyio.CancelScope(shield=True):
            for pid in list(self._running):
                _killpg(pid)
            self._killed = True
            return await anyio.to_thread.run_sync(_kill_local, self.id)

    def _resolve(self, path: str) -> Path:
        relative = PurePosixPath(path)
        if relative.is_absolute() or ".." in relative.parts:
            raise SandboxError(
                f"{path!r} is not a path inside the sandbox's working directory",
                sandbox_id=self.id,
            )
        return self._work / relative

    def _check_alive(self) -> None:
        if self._killed:
            raise SandboxError("the sandbox was killed", sandbox_id=self.id)


async def _communicate(process: Process) -> tuple[str, str]:
    chunks: dict[str, list[bytes]] = {"out": [], "err": []}

    async def drain(stream: ByteReceiveStream | None, key: str) -> None:
        if stream is None:
            return
        async for chunk in stream:
            chunks[key].append(chunk)

    async with anyio.create_task_group() as tg:
        tg.start_soon(drain, process.stdout, "out")
        tg.start_soon(drain, process.stderr, "err")
        await process.wait()
    return (
        b"".join(chunks["out"]).decode(errors="replace"),
        b"".join(chunks["err"]).decode(errors="replace"),
    )


def _killpg(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def marked_pids(var: str, value: str | None = None) -> list[int]:
    """Pids of the other live processes whose environment sets `var` (to `value`, if given).

    How what a sandbox or an MCP server started is found again whoever its parent is now:
    the mark is inherited by every process it starts. Empty where there is no `/proc`.
    """
    prefix = f"{var}=".encode()
    exact = None if value is None else prefix + value.encode()
    proc = Path("/proc")
    found = []
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(v.startswith(prefix) if exact is None else v == exact for v in environ):
            found.append(int(entry.name))
    return found


def _kill_local(sandbox_id: str) -> bool:
    """Kill every process labelled with this sandbox and remove its directory.

    Only a directory that carries the plies marker naming itself is removed, so a wrong id
    can never delete anything else. Processes are found by the `PLIES_SANDBOX_ID` variable
    in their environment, which survives `cd` and is inherited by children.
    """
    path = Path(sandbox_id)
    marker = path / _MARKER
    if not path.name.startswith(_PREFIX):
        raise SandboxError(f"{sandbox_id!r} is not a local plies sandbox", sandbox_id=sandbox_id)
    try:
        label = json.loads(marker.read_text())
    except FileNotFoundError:
        label = None
    except (OSError, ValueError) as err:
        raise SandboxError(f"unreadable sandbox marker: {err}", sandbox_id=sandbox_id) from err
    if label is not None and label.get("id") != sandbox_id:
        raise SandboxError("the sandbox marker names another sandbox", sandbox_id=sandbox_id)
    for pid in marked_pids(_ID_VAR, sandbox_id):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    if label is None:
        return False
    try:
        marker.unlink()  # first, so a half-removed directory is never mistaken for live
        shutil.rmtree(path)
    except FileNotFoundError:
        return False
    except OSError as err:
        raise SandboxError(f"could not remove the sandbox: {err}", sandbox_id=sandbox_id) from err
    return True


def new_episode_id(task_id: str) -> str:
    """A unique episode id: group members share a task id, but never a sandbox."""
    return f"{task_id}-{uuid.uuid4().hex[:12]}"
