"""E2B cloud sandboxes as a `SandboxBackend`, on the `e2b` SDK's `AsyncSandbox`.

Each sandbox is created with:

- metadata naming the run and the episode (`plies_run`, `plies_episode`), so a person or a
  script can find what a run left behind in E2B's dashboard or with `AsyncSandbox.list`;
- an idempotency key derived from the run and the episode, so a create retried after an
  unknown outcome returns the same sandbox instead of leaking a second one;
- a timeout (`sandbox_timeout_s`): E2B kills the sandbox by itself after it, the reaper of
  last resort when everything else failed.

Every SDK error, and the `httpx.TransportError` the SDK lets through when its control plane
is unreachable, becomes a `SandboxError` carrying the sandbox id. `kill` is shielded from
cancellation and bounded; it returns False when the sandbox was already gone.

The `e2b` package is imported when first used, so importing plies stays fast.
"""

from __future__ import annotations

import shlex
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import anyio
import httpx

from plies import ConfigError, SandboxError

from .sandbox import CommandResult

if TYPE_CHECKING:
    from e2b import AsyncSandbox

__all__ = [
    "DEFAULT_WORKDIR",
    "E2BBackend",
    "E2BSandbox",
    "idempotency_key",
]

DEFAULT_WORKDIR = "/home/user/plies"
"""Where an episode's files live inside the sandbox (the default user's home is /home/user)."""

_KEY_NAMESPACE = uuid.UUID("6f1c5b1e-8d0a-4c55-9a61-3b1f0c2d7e42")


def idempotency_key(run_id: str, episode_id: str) -> str:
    """The create key for one episode of one run: stable, and in the form E2B accepts."""
    return str(uuid.uuid5(_KEY_NAMESPACE, f"{run_id}\0{episode_id}"))


class E2BBackend:
    """One E2B sandbox per episode.

    Args:
        template: the sandbox template; E2B's default when None.
        sandbox_timeout_s: E2B kills the sandbox after this long, whatever plies does.
        request_timeout_s: for each API and sandbox request.
        create_timeout_s: for the whole create, retries included.
        kill_timeout_s: for a kill.
        api_key, domain, debug, api_url: passed to the SDK; by default it reads
            `E2B_API_KEY`, `E2B_DOMAIN` and `E2B_DEBUG` from the environment.
        sandbox_cls: the SDK class to use; `e2b.AsyncSandbox` unless a test passes a
            stand-in with the same interface.
        workdir: where an episode's files live and commands start (made before the first).
        user: the user commands and file operations run as (`"root"` for a task whose paths
            are outside the default user's home, such as a Harbor task's `/app` and `/tests`);
            E2B's default user when None.

    Example:
        ```python
        backend = E2BBackend(sandbox_timeout_s=600)
        async with SandboxedBlackjackEnv(backend, run_id="run-1") as env:
            obs = await env.reset(Task(id="hand-1", seed=1))
        ```
    """

    kind = "e2b"

    def __init__(
        self,
        *,
        template: str | None = None,
        sandbox_timeout_s: int = 600,
        request_timeout_s: float = 30.0,
        create_timeout_s: float = 120.0,
        kill_timeout_s: float = 30.0,
        api_key: str | None = None,
        domain: str | None = None,
        debug: bool | None = None,
        api_url: str | None = None,
        sandbox_cls: type[AsyncSandbox] | None = None,
        workdir: str = DEFAULT_WORKDIR,
        user: str | None = None,
    ) -> None:
        if not workdir.startswith("/") or ".." in workdir.split("/"):
            raise ConfigError(f"an E2B workdir must be an absolute path, got {workdir!r}")
        self.template = template
        self.workdir = workdir
        self.user = user
        self.sandbox_timeout_s = sandbox_timeout_s
        self.request_timeout_s = request_timeout_s
        self.create_timeout_s = create_timeout_s
        self.kill_timeout_s = kill_timeout_s
        options = {"api_key": api_key, "domain": domain, "debug": debug, "api_url": api_url}
        self._api = {k: v for k, v in options.items() if v is not None}
        self._sandbox_cls = sandbox_cls

    def _cls(self) -> type[AsyncSandbox]:
        if self._sandbox_cls is None:
            from e2b import AsyncSandbox

            self._sandbox_cls = AsyncSandbox
        return self._sandbox_cls

    async def create(self, *, run_id: str, episode_id: str) -> E2BSandbox:
        """Create a sandbox for one episode.

        Raises:
            SandboxError: the SDK failed, or the create did not finish in
                `create_timeout_s`; then a sandbox may exist, labelled with this run and
                episode, and E2B reaps it after `sandbox_timeout_s`.
        """
        metadata = {"plies_run": run_id, "plies_episode": episode_id}
        try:
            with anyio.fail_after(self.create_timeout_s), _mapped(None, "create a sandbox"):
                sandbox = await self._cls().create(
                    template=self.template,
                    timeout=self.sandbox_timeout_s,
                    metadata=metadata,
                    idempotency_key=idempotency_key(run_id, episode_id),
                    request_timeout=self.request_timeout_s,
                    **self._api,
                )
        except TimeoutError as err:
            raise SandboxError(
                f"creating an E2B sandbox did not finish in {self.create_timeout_s}s; one may "
                f"exist with metadata {metadata} until its {self.sandbox_timeout_s}s timeout"
            ) from err
        return E2BSandbox(sandbox, self)

    async def kill(self, sandbox_id: str) -> bool:
        """Kill a sandbox by id; False if E2B no longer knows it."""
        return await self._kill(sandbox_id, lambda: self._cls().kill(sandbox_id, **self._api))

    async def _kill(self, sandbox_id: str, call: Any) -> bool:
        with anyio.CancelScope(shield=True):
            try:
                with anyio.fail_after(self.kill_timeout_s), _mapped(sandbox_id, "kill"):
                    return bool(await call())
            except TimeoutError as err:
                raise SandboxError(
                    f"killing the sandbox did not finish in {self.kill_timeout_s}s",
                    sandbox_id=sandbox_id,
                ) from err


class E2BSandbox:
    """One E2B sandbox; files and commands live under its backend's `workdir`.

    `read_path` and `write_path` take absolute paths: a task whose paths lie outside the
    workdir (a Harbor task's `/tests`, `/logs`) is laid out and read through them.
    """

    kind = E2BBackend.kind

    def __init__(self, sandbox: AsyncSandbox, backend: E2BBackend):
        self._sandbox = sandbox
        self._backend = backend
        self.workdir = backend.workdir
        self._env: dict[str, str] = {}
        self._workdir_made = False

    @property
    def id(self) -> str:
        return self._sandbox.sandbox_id

    def set_env(self, values: Mapping[str, str]) -> None:
        """Variables every later command gets (a Dockerfile's `ENV`s, once its `RUN`s ran)."""
        self._env.update(values)

    async def run(
        self, argv: Sequence[str], *, timeout_s: float, env: Mapping[str, str] | None = None
    ) -> CommandResult:
        if not self._workdir_made:  # a command cannot start in a directory that is not there
            made = await self.run_at("/", ["mkdir", "-p", self.workdir], timeout_s=timeout_s)
            if made.exit_code != 0:
                raise SandboxError(
                    f"cannot make the workdir {self.workdir}: {made.stderr.strip()[-300:]}",
                    sandbox_id=self.id,
                )
            self._workdir_made = True
        return await self.run_at(self.workdir, argv, timeout_s=timeout_s, env=env)

    async def run_at(
        self,
        cwd: str,
        argv: Sequence[str],
        *,
        timeout_s: float,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        """`run`, starting in `cwd` instead of the workdir."""
        from e2b import CommandExitException

        envs = {**self._env, **(env or {})}
        with _mapped(self.id, "run a command"):
            try:
                result = await self._sandbox.commands.run(
                    shlex.join(argv),
                    envs=envs or None,
                    user=self._backend.user,
                    cwd=cwd,
                    timeout=timeout_s,
                    request_timeout=self._backend.request_timeout_s,
                )
            except CommandExitException as exited:  # a non-zero exit is a result, not a failure
                return CommandResult(exited.exit_code, exited.stdout, exited.stderr)
        return CommandResult(result.exit_code, result.stdout, result.stderr)

    async def read_file(self, path: str) -> bytes:
        return await self.read_path(self._path(path))

    async def write_file(self, path: str, data: bytes | str) -> None:
        await self.write_path(self._path(path), data)

    async def read_path(self, path: str) -> bytes:
        """Read a file by its absolute path in the sandbox."""
        with _mapped(self.id, f"read {path!r}"):
            data = await self._sandbox.files.read(
                _absolute(path, self.id),
                format="bytes",
                user=self._backend.user,
                request_timeout=self._backend.request_timeout_s,
            )
        return bytes(data)

    async def write_path(self, path: str, data: bytes | str) -> None:
        """Write a file by its absolute path in the sandbox (its directories are made)."""
        with _mapped(self.id, f"write {path!r}"):
            await self._sandbox.files.write(
                _absolute(path, self.id),
                data,
                user=self._backend.user,
                request_timeout=self._backend.request_timeout_s,
            )

    async def kill(self) -> bool:
        return await self._backend._kill(self.id, self._sandbox.kill)

    def _path(self, path: str) -> str:
        if path.startswith("/") or ".." in path.split("/"):
            raise SandboxError(f"{path!r} is not a path inside {self.workdir}", sandbox_id=self.id)
        return f"{self.workdir}/{path}"


def _absolute(path: str, sandbox_id: str) -> str:
    if not path.startswith("/") or ".." in path.split("/"):
        raise SandboxError(f"{path!r} is not an absolute sandbox path", sandbox_id=sandbox_id)
    return path


@contextmanager
def _mapped(sandbox_id: str | None, what: str) -> Iterator[None]:
    """Raise the SDK's errors, and the httpx errors it lets through, as `SandboxError`."""
    from e2b import AuthenticationException, SandboxException, ServiceBusyException

    try:
        yield
    except (SandboxException, AuthenticationException, ServiceBusyException) as err:
        raise SandboxError(
            f"E2B failed to {what}: {type(err).__name__}: {err}", sandbox_id=sandbox_id
        ) from err
    except httpx.TransportError as err:
        raise SandboxError(
            f"E2B could not be reached to {what}: {type(err).__name__}: {err}",
            sandbox_id=sandbox_id,
        ) from err
