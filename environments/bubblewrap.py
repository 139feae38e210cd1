"""`BubblewrapBackend`: local sandboxes whose commands run under Debian's `bwrap`.

A `LocalProcessBackend` sandbox (a marked temporary directory, killed by its mark) whose every
command runs in bubblewrap: the host's system directories read-only (`/usr`, `/etc` and the
merged-usr links), a fresh `/dev`, `/proc` and `/tmp`, the sandbox's working directory bound
writable at an absolute path of the task's choosing (`/app`), more of the sandbox's
directories bound at other absolute paths (`/logs` writable, `/tests` read-only), and its own
mount, network, pid, IPC and UTS namespaces. Nothing else of the host is visible: not `/root`,
not `/home`, not other sandboxes. The environment is cleared and set to what the sandbox
allows. Every process a command leaves behind dies with its pid namespace when it ends.

The network namespace is empty unless the backend is given `forwards`: a loopback port inside
whose connections go to a Unix socket of the host (`plies.environments._forward` listens inside,
before the command starts). An agent program run in the sandbox reaches the gateway that way,
at the URL it would use outside, and reaches nothing else. `shares` binds host directories
read-only at their own paths (an agent's installation, which must run inside).

This gives a task its absolute paths without Docker and without touching the host's root
filesystem. It is not a security boundary against a hostile kernel exploit; it is isolation
between episodes and from the host's files, and no network at all.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path, PurePosixPath

from plies import ConfigError, SandboxError

from .sandbox import CommandResult, LocalProcessBackend, LocalSandbox

__all__ = ["BubblewrapBackend", "BubblewrapSandbox", "Forward", "Mount"]

_SYSTEM_DIRS = ("/usr", "/etc")
_MERGED_USR = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_SYSTEM_PYTHON = "/usr/bin/python3"
"""Runs the forwarder inside: the system's own interpreter, visible through the `/usr` bind."""
_PLIES_DIR = "/.plies"
"""Where the forwarder and the forwarded sockets appear inside."""


@dataclass(frozen=True, slots=True)
class Mount:
    """A directory of the sandbox (relative to it) bound at an absolute path inside."""

    source: str
    target: str
    writable: bool = False


@dataclass(frozen=True, slots=True)
class Forward:
    """A loopback port inside the sandbox whose connections go to a Unix socket of the host.

    Attributes:
        port: the port commands connect to at 127.0.0.1 (use the host service's own port, so
            its URL is the same inside and out).
        socket: the host's Unix socket, e.g. `GatewayServer(uds=...)`'s.
    """

    port: int
    socket: str


class BubblewrapBackend(LocalProcessBackend):
    """Makes sandboxes whose commands run in bubblewrap with the paths a task expects.

    Args:
        workdir: where the sandbox's working directory appears inside (e.g. "/app"); commands
            start there, and `read_file` / `write_file` paths are relative to it.
        mounts: further directories of the sandbox, made empty at creation, bound inside.
        root: where sandbox directories are made on the host.
        bwrap: the bubblewrap executable.
        env_allow: host variables passed in (besides PATH, which is the sandbox's own).
        shares: host directories bound read-only at their own paths.
        forwards: the loopback ports that lead out of the sandbox (none by default).

    Raises:
        ConfigError: a path is not absolute, `bwrap` is not installed, or forwards are asked
            for without the system Python that runs them.
    """

    kind = "bwrap-sandbox"

    def __init__(
        self,
        *,
        workdir: str = "/work",
        mounts: Sequence[Mount] = (),
        root: Path | None = None,
        bwrap: str = "bwrap",
        env_allow: Sequence[str] = ("LANG", "LC_ALL", "TZ"),
        shares: Sequence[str | Path] = (),
        forwards: Sequence[Forward] = (),
    ) -> None:
        super().__init__(root, env_allow=env_allow)
        found = shutil.which(bwrap)
        if found is None:
            raise ConfigError(
                f"{bwrap!r} is not installed: the bubblewrap sandbox needs it "
                "(Debian: apt-get install bubblewrap)"
            )
        for target in (workdir, *(m.target for m in mounts)):
            pure = PurePosixPath(target)
            if not pure.is_absolute() or ".." in pure.parts or pure == PurePosixPath("/"):
                raise ConfigError(f"a sandbox path must be absolute and below /, got {target!r}")
        for m in mounts:
            if PurePosixPath(m.source).is_absolute() or ".." in PurePosixPath(m.source).parts:
                raise ConfigError(f"a mount's source is relative to the sandbox: {m.source!r}")
        for shared in shares:
            if not Path(shared).is_absolute() or not Path(shared).exists():
                raise ConfigError(f"a shared host path must be absolute and exist: {shared!r}")
        for f in forwards:
            if not 0 < f.port < 65536:
                raise ConfigError(f"a forward's port must be 1-65535, got {f.port}")
            if not Path(f.socket).is_absolute():
                raise ConfigError(f"a forward's socket must be an absolute path: {f.socket!r}")
        if forwards and not Path(_SYSTEM_PYTHON).is_file():
            raise ConfigError(f"forwards need {_SYSTEM_PYTHON} on the host, which runs them inside")
        self.bwrap = found
        self.workdir = workdir
        self.mounts = tuple(mounts)
        self.shares = tuple(str(Path(p)) for p in shares)
        self.forwards = tuple(forwards)

    def _sandbox(self, path: Path, base_env: Mapping[str, str]) -> LocalSandbox:
        for m in self.mounts:
            (path / m.source).mkdir(parents=True, exist_ok=True)
        return BubblewrapSandbox(path, base_env, self)


class BubblewrapSandbox(LocalSandbox):
    """A sandbox made by `BubblewrapBackend`; its id is the host directory, like a local one."""

    kind = BubblewrapBackend.kind

    def __init__(self, path: Path, base_env: Mapping[str, str], backend: BubblewrapBackend):
        super().__init__(path, base_env)
        self.backend = backend
        self._env.update(HOME="/root", TMPDIR="/tmp", PATH=_PATH)

    def set_env(self, values: Mapping[str, str]) -> None:
        """Variables every later command gets (a Dockerfile's `ENV`s, once its `RUN`s ran)."""
        self._env.update(values)

    @property
    def workdir(self) -> Path:
        """The working directory as commands inside see it (e.g. `/app`)."""
        return Path(self.backend.workdir)

    @property
    def host_workdir(self) -> Path:
        """Where the working directory lies on the host (to put files in from outside)."""
        return self._work

    async def run(
        self, argv: Sequence[str], *, timeout_s: float, env: Mapping[str, str] | None = None
    ) -> CommandResult:
        result = await super().run(argv, timeout_s=timeout_s, env=env)
        if result.exit_code == 1 and result.stderr.startswith("bwrap: "):
            # bubblewrap itself failed (no user namespaces, a missing path): not the command.
            reason = result.stderr.splitlines()[0]
            raise SandboxError(
                f"bubblewrap could not start the sandbox: {reason}", sandbox_id=self.id
            )
        return result

    def host_path(self, source: str) -> Path:
        """Where a mount's directory lies on the host (to put files in from outside)."""
        return Path(self.id) / source

    def _command(self, argv: list[str], env: Mapping[str, str]) -> list[str]:
        b = self.backend
        cmd = [b.bwrap, "--die-with-parent", "--unshare-net", "--unshare-pid", "--unshare-ipc"]
        cmd += ["--unshare-uts", "--hostname", "sandbox"]
        for d in _SYSTEM_DIRS:
            cmd += ["--ro-bind", d, d]
        for d in _MERGED_USR:
            host = Path(d)
            if host.is_symlink():
                cmd += ["--symlink", str(host.readlink()), d]
            elif host.is_dir():
                cmd += ["--ro-bind", d, d]
        cmd += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--tmpfs", "/root"]
        cmd += ["--bind", str(self.host_workdir), b.workdir]
        for m in b.mounts:
            bind = "--bind" if m.writable else "--ro-bind"
            cmd += [bind, str(self.host_path(m.source)), m.target]
        for shared in b.shares:
            cmd += ["--ro-bind", shared, shared]
        if b.forwards:
            forwarder = resources.files("plies.environments").joinpath("_forward.py")
            cmd += ["--ro-bind", str(Path(str(forwarder)).resolve()), f"{_PLIES_DIR}/forward.py"]
            relay = [_SYSTEM_PYTHON, "-I", f"{_PLIES_DIR}/forward.py"]
            for k, f in enumerate(b.forwards):
                inside = f"{_PLIES_DIR}/forward-{k}.sock"
                cmd += ["--bind", f.socket, inside]
                relay.append(f"127.0.0.1:{f.port}={inside}")
            argv = [*relay, "--", *argv]
        cmd += ["--chdir", b.workdir, "--clearenv"]
        for key, value in env.items():
            cmd += ["--setenv", key, value]
        return [*cmd, "--", *argv]
