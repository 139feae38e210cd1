"""A stand-in for E2B's cloud with the `e2b.AsyncSandbox` interface and the SDK's own errors.

E2B's cloud cannot be reached from tests, and the SDK's Rust transport cannot be intercepted
at the httpx level, so this fake replaces the `AsyncSandbox` class. Its methods have the same
signatures as the SDK's (a test checks that), raise the SDK's own exception classes built by
the SDK's own helpers, validate idempotency keys with the SDK's validator, and really run
commands: each fake sandbox is a directory standing in for the sandbox's filesystem root, and
commands run as subprocesses inside it.

`FakeE2BCloud` holds the state one test sees (no module state) and the faults it injects.
With `isolated=True` each sandbox's directory is its root filesystem, as a real sandbox's is:
commands run in bubblewrap with that directory at `/` (the host's `/usr` and `/etc` read-only
standing in for the template's system), so a task's absolute paths (`/app`, `/tests`) land in
the sandbox, not on the host.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import uuid
from collections.abc import AsyncIterable, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

import anyio
from e2b import CommandExitException, CommandResult, FileNotFoundException, TimeoutException
from e2b.exceptions import format_sandbox_unavailable_exception
from e2b.retry import resolve_idempotency_key
from e2b.sandbox.filesystem.filesystem import FileType, WriteInfo
from e2b.sandbox.utils import class_method_variant


@dataclass
class FakeSandboxRecord:
    sandbox_id: str
    root: Path
    template: str | None
    timeout: int | None
    metadata: dict[str, str]
    idempotency_key: str | None
    commands: list[str] = field(default_factory=list)


class FakeE2BCloud:
    """What E2B's control plane knows, plus knobs for faults."""

    def __init__(self, root: Path, *, isolated: bool = False):
        self.root = root
        self.isolated = isolated
        self.sandboxes: dict[str, FakeSandboxRecord] = {}
        self.by_key: dict[str, str] = {}
        self.creates = 0
        self.create_error: BaseException | None = None
        self.kill_error: BaseException | None = None
        self.create_delay_s = 0.0
        self.kill_delay_s = 0.0
        self.sandbox_class = type("AsyncSandbox", (FakeAsyncSandbox,), {"_cloud": self})

    def vanish(self, sandbox_id: str) -> None:
        """The sandbox disappears before its timeout, as E2B sandboxes sometimes do."""
        record = self.sandboxes.pop(sandbox_id)
        shutil.rmtree(record.root, ignore_errors=True)

    def _require(self, sandbox_id: str) -> FakeSandboxRecord:
        record = self.sandboxes.get(sandbox_id)
        if record is None:  # what the proxy in front of envd answers for a gone sandbox
            raise format_sandbox_unavailable_exception(f"The sandbox {sandbox_id} was not found")
        return record


class FakeAsyncSandbox:
    """The parts of `e2b.AsyncSandbox` plies uses, with the SDK's signatures."""

    _cloud: FakeE2BCloud

    def __init__(self, record: FakeSandboxRecord):
        self._record = record
        self.commands = FakeCommands(self._cloud, record.sandbox_id)
        self.files = FakeFilesystem(self._cloud, record.sandbox_id)

    @property
    def sandbox_id(self) -> str:
        return self._record.sandbox_id

    @classmethod
    async def create(
        cls,
        template: str | None = None,
        timeout: int | None = None,
        metadata: dict[str, str] | None = None,
        envs: dict[str, str] | None = None,
        secure: bool | None = None,
        allow_internet_access: bool | None = None,
        mcp: Any = None,
        network: Any = None,
        iam: Any = None,
        lifecycle: Any = None,
        volume_mounts: Any = None,
        logger: Any = None,
        idempotency_key: str | None = None,
        **opts: Any,
    ) -> FakeAsyncSandbox:
        cloud = cls._cloud
        key = resolve_idempotency_key(idempotency_key)
        await anyio.sleep(cloud.create_delay_s)
        if cloud.create_error is not None:
            raise cloud.create_error
        if key is not None and cloud.by_key.get(key) in cloud.sandboxes:
            return cls(cloud.sandboxes[cloud.by_key[key]])
        cloud.creates += 1
        sandbox_id = f"fake{uuid.uuid4().hex[:16]}"
        root = cloud.root / sandbox_id
        (root / "home" / "user").mkdir(parents=True)
        if cloud.isolated:
            for d in _SYSTEM_LINKS:
                if Path(d).is_symlink():
                    (root / d.lstrip("/")).symlink_to(Path(d).readlink())
        record = FakeSandboxRecord(sandbox_id, root, template, timeout, dict(metadata or {}), key)
        cloud.sandboxes[sandbox_id] = record
        if key is not None:
            cloud.by_key[key] = sandbox_id
        return cls(record)

    @class_method_variant("_cls_kill")
    async def kill(self, **opts: Any) -> bool:
        return await type(self)._cls_kill(self.sandbox_id, **opts)

    @classmethod
    async def _cls_kill(cls, sandbox_id: str, **opts: Any) -> bool:
        cloud = cls._cloud
        await anyio.sleep(cloud.kill_delay_s)
        if cloud.kill_error is not None:
            raise cloud.kill_error
        record = cloud.sandboxes.pop(sandbox_id, None)
        if record is None:
            return False  # the API's 404
        await anyio.to_thread.run_sync(lambda: shutil.rmtree(record.root, ignore_errors=True))
        return True


class FakeCommands:
    def __init__(self, cloud: FakeE2BCloud, sandbox_id: str):
        self._cloud, self._id = cloud, sandbox_id

    async def run(
        self,
        cmd: str,
        background: bool | None = None,
        envs: dict[str, str] | None = None,
        user: str | None = None,
        cwd: str | None = None,
        on_stdout: Callable[[str], None] | Callable[[str], Awaitable[None]] | None = None,
        on_stderr: Callable[[str], None] | Callable[[str], Awaitable[None]] | None = None,
        stdin: bool | None = None,
        timeout: float | None = 60,
        request_timeout: float | None = None,
        *,
        retain_output: bool = True,
    ) -> CommandResult:
        record = self._cloud._require(self._id)
        record.commands.append(cmd)
        argv = shlex.split(cmd)
        if self._cloud.isolated:
            env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/home/user"}
            argv = [*_rooted(record.root, cwd or "/home/user"), *argv]
            workdir = record.root
        else:
            workdir = record.root / (cwd or "/home/user").lstrip("/")
            # The template's python3 is this interpreter; the rest of PATH is a stock image's.
            path = f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"
            env = {"PATH": path, "HOME": str(record.root / "home/user")}
        with anyio.move_on_after(timeout or 3600) as scope:
            done = await anyio.run_process(
                argv, cwd=workdir, env={**env, **(envs or {})}, check=False,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        if scope.cancelled_caught:
            raise TimeoutException("context deadline exceeded: the command timed out")
        self._cloud._require(self._id)  # killed while running: the stream ends with an error
        stdout, stderr = done.stdout.decode(), done.stderr.decode()
        if done.returncode != 0:
            raise CommandExitException(
                stderr=stderr, stdout=stdout, exit_code=done.returncode, error=None
            )
        return CommandResult(stderr=stderr, stdout=stdout, exit_code=0, error=None)


_SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib64")
"""Merged-usr links of the host, made once in an isolated sandbox's root at create."""


def _rooted(root: Path, cwd: str) -> list[str]:
    """bubblewrap with `root` as `/`: the sandbox's own filesystem, the host's system beside."""
    cmd = ["bwrap", "--die-with-parent", "--unshare-pid", "--bind", str(root), "/"]
    cmd += ["--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
    for d in _SYSTEM_LINKS:
        host = Path(d)
        if host.is_dir() and not host.is_symlink():
            cmd += ["--ro-bind", d, d]
    cmd += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--chdir", cwd, "--"]
    return cmd


class FakeFilesystem:
    def __init__(self, cloud: FakeE2BCloud, sandbox_id: str):
        self._cloud, self._id = cloud, sandbox_id

    def _local(self, path: str) -> Path:
        record = self._cloud._require(self._id)
        return record.root / path.lstrip("/")

    async def read(
        self,
        path: str,
        format: Literal["text", "bytes", "stream"] = "text",
        user: str | None = None,
        request_timeout: float | None = None,
        gzip: bool = False,
        stream_idle_timeout: float | None = None,
    ) -> Any:
        local = self._local(path)
        if not local.is_file():
            raise FileNotFoundException(f"path '{path}' does not exist")
        data = local.read_bytes()
        return data.decode() if format == "text" else bytearray(data)

    async def write(
        self,
        path: str,
        data: str | bytes | IO | AsyncIterable[bytes],
        user: str | None = None,
        request_timeout: float | None = None,
        gzip: bool = False,
        use_octet_stream: bool | None = None,
        metadata: dict[str, str] | None = None,
    ) -> WriteInfo:
        local = self._local(path)
        local.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, str):
            local.write_text(data)
        elif isinstance(data, bytes | bytearray):
            local.write_bytes(bytes(data))
        else:
            raise TypeError("the fake writes str or bytes only")
        return WriteInfo(name=local.name, type=FileType.FILE, path=path, metadata=metadata)
