"""Harbor task directories as plies envs, run in a bubblewrap sandbox per episode.

A Harbor task is a directory: `task.toml` (timeouts, resources), `instruction.md` (the task),
`environment/Dockerfile` (the workspace), `tests/test.sh` (writes `/logs/verifier/reward.txt`
or `reward.json`), and optionally `solution/solve.sh` (a reference solution).

- `HarborTask.load(path)`: reads the task with `tomllib` (Harbor itself needs Python 3.12; a CI
  tier checks that Harbor's own loader accepts the tasks plies ships) and plans its Dockerfile.
  An instruction the sandbox cannot honour is refused here, in one line naming the file, the
  line and the instruction, before any episode starts.
- `HarborEnv`: one episode. The instruction is the user's message; the workspace is built in
  a fresh `BubblewrapBackend` sandbox from the Dockerfile (its `COPY`s, `ENV`s and `RUN`s, with
  the build timeout), at its `WORKDIR` (or `[environment].workdir`), with `/logs` writable and
  no network. Tools: `bash` (a command in the workspace, bounded by what is left of the agent
  timeout) and `submit`, which runs `tests/test.sh` (copied to `/tests` only then, with the
  verifier timeout) and ends the episode with the reward it wrote. When the agent's time is
  up, the next call verifies and ends the episode instead. `oracle()` runs
  `solution/solve.sh` (at `/solution`) and verifies, as Harbor's oracle agent does.
- An agent program (Claude Code, Codex, ...) can play it too, through `AgentHarness`: it runs
  inside the sandbox with its own tools, reaches the gateway through a forwarded port (its
  installation shared read-only), and `verify()` runs the tests once it has exited.

What the sandbox makes of a Dockerfile is `plies.environments.dockerfile`'s: the host's system
stands in for the base image; `WORKDIR`, `ENV`, local copies and `RUN`s are honoured; what
cannot be is refused when the task loads.
"""

from __future__ import annotations

import json
import math
import shutil
import time
import tomllib
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Annotated, Any

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from plies import ConfigError, EnvError, SandboxError
from plies.runtime import RemoteRef

from ._env import Env, Observation, Task, ToolResult, tool
from .bubblewrap import BubblewrapBackend, BubblewrapSandbox, Forward, Mount
from .dockerfile import CopyStep, DockerfilePlan, plan_dockerfile
from .e2b_backend import E2BBackend, E2BSandbox
from .mcp_client import McpServer
from .sandbox import new_episode_id

__all__ = ["HARBOR_MOUNTS", "HarborEnv", "HarborTask"]

HARBOR_MOUNTS = (
    Mount("logs", "/logs", writable=True),
    Mount("tests", "/tests"),
    Mount("solution", "/solution"),
)
"""The absolute paths a Harbor task's scripts use besides the workspace."""

_VERIFIER = "/logs/verifier"
"""Where a task's tests write its reward; emptied before they run."""
_FILE_OP_S = 60.0
"""The most one file operation of the sandbox may take."""

MAX_OUTPUT_CHARS = 8000
"""What a `bash` call shows the model of its output: the head and the tail beyond this."""


class _Timeouts(BaseModel):
    model_config = ConfigDict(extra="ignore")
    timeout_sec: Annotated[float, Field(gt=0)] | None = None
    env: dict[str, str] = Field(default_factory=dict)
    user: str | int | None = None


class _Environment(BaseModel):
    model_config = ConfigDict(extra="ignore")
    build_timeout_sec: Annotated[float, Field(gt=0)] = 600.0
    docker_image: str | None = None
    workdir: str | None = None
    os: str = "linux"
    gpus: int | None = None
    mcp_servers: list[Any] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)


class _TaskToml(BaseModel):
    """The parts of Harbor's `task.toml` an episode depends on; other keys are Harbor's own."""

    model_config = ConfigDict(extra="ignore")
    agent: _Timeouts = Field(default_factory=_Timeouts)
    verifier: _Timeouts = Field(default_factory=_Timeouts)
    solution: _Timeouts = Field(default_factory=_Timeouts)
    environment: _Environment = Field(default_factory=_Environment)
    steps: list[Any] | None = None


@dataclass(frozen=True, slots=True)
class HarborTask:
    """A Harbor task directory, read and planned.

    Attributes:
        path: the task directory.
        name: its directory name.
        instruction: `instruction.md`.
        plan: the workspace's `DockerfilePlan`.
        agent_timeout_s: `[agent].timeout_sec` (None: no limit).
        verifier_timeout_s: `[verifier].timeout_sec` (Harbor's default, 600 s, when unset).
        build_timeout_s: `[environment].build_timeout_sec`.
        verifier_env: `[verifier].env`; `solution_env`: `[solution].env`.
    """

    path: Path
    name: str
    instruction: str
    plan: DockerfilePlan
    agent_timeout_s: float | None
    verifier_timeout_s: float
    build_timeout_s: float
    verifier_env: dict[str, str]
    solution_env: dict[str, str]

    @classmethod
    def load(cls, path: Path | str) -> HarborTask:
        """Read a task directory; refuse what a bubblewrap episode cannot honour, in one line.

        Raises:
            ConfigError: a file is missing or malformed, or the task needs what the sandbox
                does not give (a prebuilt image, Windows, GPUs, MCP servers, steps, an
                instruction of its Dockerfile).
        """
        root = Path(path).resolve()
        toml_path = root / "task.toml"
        try:
            raw = tomllib.loads(toml_path.read_text())
            config = _TaskToml.model_validate(raw)
        except OSError as err:
            raise ConfigError(f"{toml_path}: cannot read: {err}") from err
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{toml_path}: not TOML: {err}") from err
        except ValidationError as err:
            first = err.errors(include_url=False)[0]
            where = ".".join(str(x) for x in first["loc"])
            raise ConfigError(f"{toml_path}: {where}: {first['msg']}") from None
        environment = config.environment
        unsupported = [
            (config.steps, "multi-step tasks ([[steps]])"),
            (environment.docker_image, "a prebuilt docker_image"),
            (environment.os.lower() != "linux", f"os = {environment.os!r}"),
            (environment.gpus, "GPUs"),
            (environment.mcp_servers, "[[environment.mcp_servers]]"),
        ]
        for present, what in unsupported:
            if present:
                raise ConfigError(f"{toml_path}: {what} cannot be honoured by the local sandbox")
        for name in ("instruction.md", "environment/Dockerfile", "tests/test.sh"):
            if not (root / name).is_file():
                raise ConfigError(f"{root}: a Harbor task needs {name}")
        plan = plan_dockerfile(root / "environment" / "Dockerfile", workdir=environment.workdir)
        plan.env.update(environment.env)
        return cls(
            path=root,
            name=root.name,
            instruction=(root / "instruction.md").read_text().strip(),
            plan=plan,
            agent_timeout_s=config.agent.timeout_sec,
            verifier_timeout_s=config.verifier.timeout_sec or 600.0,
            build_timeout_s=environment.build_timeout_sec,
            verifier_env=dict(config.verifier.env),
            solution_env=dict(config.solution.env),
        )

    @property
    def has_solution(self) -> bool:
        return (self.path / "solution" / "solve.sh").is_file()

    def backend(
        self,
        root: Path | None = None,
        *,
        shares: Sequence[str | Path] = (),
        forwards: Sequence[Forward] = (),
    ) -> BubblewrapBackend:
        """A bubblewrap backend with this task's workspace path and Harbor's mounts.

        For an agent program run inside (`AgentHarness`): `shares` are its installation's
        directories, `forwards` the gateway's port (see `BubblewrapBackend`).
        """
        return BubblewrapBackend(
            workdir=self.plan.workdir,
            mounts=HARBOR_MOUNTS,
            root=root,
            shares=shares,
            forwards=forwards,
        )

    def e2b_backend(self, **options: Any) -> E2BBackend:
        """An E2B backend for this task: its workdir, commands and files as root (the task's
        paths lie outside the default user's home). `options` go to `E2BBackend` (template,
        timeouts, API key). The template's system stands in for the Dockerfile's `FROM`."""
        return E2BBackend(workdir=self.plan.workdir, user="root", **options)


class HarborEnv(Env):
    """One episode of a Harbor task in its own bubblewrap sandbox.

    Args:
        task: the loaded task.
        backend: makes the sandbox; `task.backend()` by default.
        run_id: names the run in the sandbox's label.
        command_timeout_s: the most one `bash` call may take (less when the agent's time is
            nearly up).
        system_prompt: an optional system message before the instruction.

    Example:
        ```python
        task = HarborTask.load("examples/harbor/fix-mean")
        async with HarborEnv(task) as env:
            obs = await env.reset(Task(id=task.name))
            await env.call_tool("bash", {"command": "python3 -m unittest"})
            result = await env.call_tool("submit", {})  # result.reward: what test.sh wrote
        ```
    """

    def __init__(
        self,
        task: HarborTask,
        backend: BubblewrapBackend | E2BBackend | None = None,
        *,
        run_id: str = "harbor",
        command_timeout_s: float = 120.0,
        system_prompt: str | None = None,
    ) -> None:
        super().__init__()
        self.task = task
        self.backend = backend if backend is not None else task.backend()
        self.run_id = run_id
        self.command_timeout_s = command_timeout_s
        self.system_prompt = system_prompt
        self.sandbox: BubblewrapSandbox | E2BSandbox | None = None
        self._agent_deadline: float | None = None

    def remote_refs(self) -> list[RemoteRef]:
        if self.sandbox is None:
            return []
        detail = {"run_id": self.run_id, "task": self.task.name}
        return [RemoteRef(kind=self.sandbox.kind, id=self.sandbox.id, detail=detail)]

    async def setup(self, task: Task) -> Observation:
        with anyio.CancelScope(shield=True):  # a sandbox made is a sandbox teardown must know
            sandbox = await self.backend.create(
                run_id=self.run_id, episode_id=new_episode_id(task.id)
            )
        assert isinstance(sandbox, BubblewrapSandbox | E2BSandbox)
        self.sandbox = sandbox
        await self._build(sandbox)
        if self.task.agent_timeout_s is not None:
            self._agent_deadline = time.monotonic() + self.task.agent_timeout_s
        messages = [{"role": "user", "content": self.task.instruction}]
        if self.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        info = {"harbor_task": self.task.name, "workdir": self.task.plan.workdir}
        return Observation(messages=messages, info=info)

    async def teardown(self) -> None:
        sandbox = self.sandbox
        if sandbox is not None:
            await sandbox.kill()
            self.sandbox = None

    @property
    def workspace(self) -> BubblewrapSandbox | E2BSandbox:
        """The episode's sandbox: an agent program runs in it (`AgentHarness`).

        Raises:
            EnvError: the env was not reset yet, or was torn down.
        """
        return self._sandbox()

    @property
    def agent_timeout_s(self) -> float | None:
        """`[agent].timeout_sec`: how long an agent program may work before it is cut off."""
        return self.task.agent_timeout_s

    def serve_tools(self) -> AbstractAsyncContextManager[Mapping[str, McpServer]]:
        """None for an agent program: a task that names MCP servers is refused when it loads."""
        return nullcontext({})

    async def verify(self) -> float:
        """Run the task's tests after an agent program exited; the reward they wrote.

        Raises:
            EnvError: the tests did not finish in time or wrote no readable reward.
        """
        return (await self._verify(agent_timeout=False)).reward

    @tool
    async def bash(
        self, command: Annotated[str, Field(description="A bash command, run in the workspace.")]
    ) -> ToolResult:
        """Run a bash command in the task's workspace and see its exit code and output."""
        left = self._time_left()
        if left is not None and left <= 0:
            return await self._verify(agent_timeout=True)
        limit = self.command_timeout_s if left is None else min(self.command_timeout_s, left)
        try:
            result = await self._sandbox().run(["bash", "-c", command], timeout_s=limit)
        except SandboxError as err:
            if "did not finish" not in str(err):
                raise
            return ToolResult(content=f"The command timed out after {limit:.0f}s and was killed.")
        text = f"exit code {result.exit_code}\n{result.stdout}{result.stderr}"
        return ToolResult(content=_clip(text), info={"exit_code": result.exit_code})

    @tool
    async def submit(self) -> ToolResult:
        """Say that the task is done: its tests then run, and the episode ends."""
        return await self._verify(agent_timeout=False)

    async def oracle(self) -> ToolResult:
        """Run `solution/solve.sh` at `/solution` (agent timeout), then verify; ends the episode.

        Raises:
            ConfigError: the task has no solution.
        """
        if not self.task.has_solution:
            raise ConfigError(f"task {self.task.name} has no solution/solve.sh")
        sandbox = self._sandbox()
        await self._place().put(self.task.path / "solution", "/solution")
        limit = self.task.agent_timeout_s or self.command_timeout_s
        result = await sandbox.run(
            ["bash", "/solution/solve.sh"], timeout_s=limit, env=self.task.solution_env
        )
        verified = await self._verify(agent_timeout=False)
        info = {**verified.info, "solve_exit_code": result.exit_code}
        return verified.model_copy(update={"info": info})

    def _time_left(self) -> float | None:
        if self._agent_deadline is None:
            return None
        return self._agent_deadline - time.monotonic()

    def _place(self) -> _BubblewrapPaths | _E2BPaths:
        """The task's absolute paths in this episode's sandbox, by its kind."""
        sandbox = self._sandbox()
        if isinstance(sandbox, BubblewrapSandbox):
            return _BubblewrapPaths(sandbox)
        return _E2BPaths(sandbox)

    def _sandbox(self) -> BubblewrapSandbox | E2BSandbox:
        if self.sandbox is None:
            raise EnvError(f"the sandbox of task {self.task.name} is gone")
        return self.sandbox

    async def _build(self, sandbox: BubblewrapSandbox | E2BSandbox) -> None:
        plan = self.task.plan
        deadline = time.monotonic() + self.task.build_timeout_s
        place = self._place()
        for mount in HARBOR_MOUNTS:
            await place.clear(mount.target)
        for step in plan.steps:
            if isinstance(step, CopyStep):
                await place.put(step.source, str(PurePosixPath(plan.workdir) / step.dest))
                continue
            where = f"{self.task.path}/environment/Dockerfile:{step.line}: RUN"
            left = deadline - time.monotonic()
            try:
                result = await sandbox.run(
                    ["sh", "-c", step.command], timeout_s=max(left, 0.001), env=step.env
                )
            except SandboxError as err:
                raise EnvError(
                    f"{where} did not finish within the build timeout "
                    f"({self.task.build_timeout_s:g}s)"
                ) from err
            if result.exit_code != 0:
                tail = (result.stderr or result.stdout).strip()[-300:]
                raise EnvError(
                    f"{where} failed in the sandbox with exit code {result.exit_code}: {tail}"
                )
        sandbox.set_env(plan.env)  # what the image ends with: the agent's and tests' commands

    async def _verify(self, *, agent_timeout: bool) -> ToolResult:
        sandbox, place = self._sandbox(), self._place()
        await place.clear(_VERIFIER)
        await place.put(self.task.path / "tests", "/tests")
        try:
            result = await sandbox.run(
                ["bash", "/tests/test.sh"],
                timeout_s=self.task.verifier_timeout_s,
                env=self.task.verifier_env,
            )
        except SandboxError as err:
            raise EnvError(
                f"the tests of {self.task.name} did not finish in "
                f"{self.task.verifier_timeout_s:g}s: the reward is unknown"
            ) from err
        text = await place.read(f"{_VERIFIER}/reward.txt")
        json_text = None if text is not None else await place.read(f"{_VERIFIER}/reward.json")
        rewards = _rewards(text, json_text, self.task.name)
        reward = float(rewards.get("reward", next(iter(rewards.values()))))
        info = {"rewards": rewards, "test_exit_code": result.exit_code}
        if agent_timeout:
            info["agent_timeout"] = True
        text = "The tests ran." if not agent_timeout else "Time is up; the tests ran."
        return ToolResult(content=text, reward=reward, done=True, info=info)


def _rewards(text: bytes | None, json_text: bytes | None, name: str) -> dict[str, float]:
    """Harbor's rules: reward.txt holds one number; else reward.json a number per key."""
    try:
        if text is not None:
            rewards: Any = {"reward": float(text.decode())}
        elif json_text is not None:
            rewards = json.loads(json_text)
            rewards = rewards if isinstance(rewards, dict) else {"reward": rewards}
        else:
            raise EnvError(f"the tests of {name} wrote no reward.txt or reward.json")
        values = {str(k): v for k, v in rewards.items()}
        if not values or not all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            for v in values.values()
        ):
            raise EnvError(f"the tests of {name} wrote rewards that are not finite numbers")
        return {k: float(v) for k, v in values.items()}
    except ValueError as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise EnvError(f"the tests of {name} wrote an unreadable reward: {err}") from err


class _BubblewrapPaths:
    """The task's absolute paths in a bubblewrap sandbox: host directories bound inside."""

    def __init__(self, sandbox: BubblewrapSandbox) -> None:
        self.sandbox = sandbox
        self._binds = [(PurePosixPath(str(sandbox.workdir)), sandbox.host_workdir)]
        self._binds += [
            (PurePosixPath(m.target), sandbox.host_path(m.source)) for m in HARBOR_MOUNTS
        ]

    def _host(self, path: str) -> Path:
        inside = PurePosixPath(path)
        for target, host in self._binds:
            if inside == target or target in inside.parents:
                return host / inside.relative_to(target)
        raise EnvError(f"{path} is not a path the sandbox binds")

    async def put(self, source: Path, target: str) -> None:
        copy = _copy_tree if source.is_dir() else _copy_file
        await copy(source, self._host(target))

    async def read(self, path: str) -> bytes | None:
        host = anyio.Path(self._host(path))
        return await host.read_bytes() if await host.is_file() else None

    async def clear(self, path: str) -> None:
        host = self._host(path)
        await anyio.to_thread.run_sync(lambda: shutil.rmtree(host, ignore_errors=True))
        await anyio.Path(host).mkdir(parents=True)


class _E2BPaths:
    """The task's absolute paths in an E2B sandbox: real directories of its filesystem."""

    def __init__(self, sandbox: E2BSandbox) -> None:
        self.sandbox = sandbox

    async def put(self, source: Path, target: str) -> None:
        files = (
            [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
        )
        for path in files:
            relative = "" if path == source else path.relative_to(source).as_posix()
            where = str(PurePosixPath(target) / relative) if relative else target
            await self.sandbox.write_path(where, await anyio.Path(path).read_bytes())

    async def read(self, path: str) -> bytes | None:
        found = await self.sandbox.run_at("/", ["test", "-f", path], timeout_s=_FILE_OP_S)
        return await self.sandbox.read_path(path) if found.exit_code == 0 else None

    async def clear(self, path: str) -> None:
        done = await self.sandbox.run_at(
            "/", ["sh", "-c", 'rm -rf "$1" && mkdir -p "$1"', "sh", path], timeout_s=_FILE_OP_S
        )
        if done.exit_code != 0:
            raise EnvError(f"cannot empty {path} in the sandbox: {done.stderr.strip()[-300:]}")


def _clip(text: str, limit: int = MAX_OUTPUT_CHARS) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - limit} characters cut ...]\n{text[-half:]}"


async def _copy_tree(source: Path, target: Path) -> None:
    def copy() -> None:
        target.mkdir(parents=True, exist_ok=True)
        shutil.copytree(source, target, dirs_exist_ok=True, symlinks=True)

    await anyio.to_thread.run_sync(copy)


async def _copy_file(source: Path, target: Path) -> None:
    def copy() -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)

    await anyio.to_thread.run_sync(copy)
