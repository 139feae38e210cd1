"""`BubblewrapBackend`: local sandboxes whose commands run under Debian's `bwrap`.

A `LocalProcessBackend` sandbox (a marked temporary directory, killed by its mark) whose every
command runs in bubblewrap: the host's system directories read-only (`/usr`, `/etc` and the
merged-usr links), a fresh `/dev`, `/proc` and `/tmp`, the sandbox's working directory bound
writable at an absolute path of the task's choosing (`/app`), more of the sandbox's
directories bound at other absolute paths (`/logs` writable, `/tests` read-only), and its own
mount, network, pid, IPC and UTS namespaces. Nothing else of the host is visible: not `/root`,
not `/home`, not other sandboxes. The environment is cleared and set to what the sandbox
allows. Every process a command leaves behind dies with its pid namespace when it ends.

This gives a task its absolute paths without Docker and without touching the host's root
filesystem. It is not a security boundary against a hostile kernel exploit; it is isolation
between episodes and from the host's files, and no network at all.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from plies import ConfigError, SandboxError

from .sandbox import CommandResult, LocalProcessBackend, LocalSandbox

__all__ = ["BubblewrapBackend", "BubblewrapSandbox", "Mount"]

_SYSTEM_DIRS = ("/usr", "/etc")
_MERGED_USR = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True, slots=True)
class Mount:
    """A directory of the sandbox (relative to it) bound at an absolute path inside."""

    source: str
    target: str
    writable: bool = False


class BubblewrapBackend(LocalProcessBackend):
    """Makes sandboxes whose commands run in bubblewrap with the paths a task expects.

    Args:
        workdir: where the sandbox's working directory appears inside (e.g. "/app"); commands
            start there, and `read_file` / `write_file` paths are relative to it.
        mounts: further directories of the sandbox, made empty at creation, bound inside.
        root: where sandbox directories are made on the host.
        bwrap: the bubblewrap executable.
        env_allow: host variables passed in (besides PATH, which is the sandbox's own).

    Raises:
        ConfigError: a path is not absolute, or `bwrap` is not installed.
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
        self.bwrap = found
        self.workdir = workdir
        self.mounts = tuple(mounts)

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
        cmd += ["--bind", str(self.workdir), b.workdir]
        for m in b.mounts:
            bind = "--bind" if m.writable else "--ro-bind"
            cmd += [bind, str(self.host_path(m.source)), m.target]
        cmd += ["--chdir", b.workdir, "--clearenv"]
        for key, value in env.items():
            cmd += ["--setenv", key, value]
        return [*cmd, "--", *argv]
