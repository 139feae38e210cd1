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

What the sandbox makes of a Dockerfile: the host's system directories stand in for the base
image (`FROM` is read, not pulled), so a task may use what Debian has (bash, coreutils,
python3); `WORKDIR`, `ENV`, `ARG` defaults, local `COPY`/`ADD` into the workspace and `RUN`
are honoured; `CMD`, `ENTRYPOINT`, `EXPOSE`, `LABEL`, `HEALTHCHECK` and `STOPSIGNAL` do not
change what an episode sees and are ignored; everything else is refused, as are `RUN`s that
need the network (package managers, downloads), copies out of the workspace, URLs, archives,
other stages and other users.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Annotated, Any

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from plies import ConfigError, EnvError, SandboxError
from plies.runtime import RemoteRef

from ._env import Env, Observation, Task, ToolResult, tool
from .bubblewrap import BubblewrapBackend, BubblewrapSandbox, Mount
from .sandbox import new_episode_id

__all__ = [
    "HARBOR_MOUNTS",
    "CopyStep",
    "DockerfilePlan",
    "HarborEnv",
    "HarborTask",
    "RunStep",
    "plan_dockerfile",
]

HARBOR_MOUNTS = (
    Mount("logs", "/logs", writable=True),
    Mount("tests", "/tests"),
    Mount("solution", "/solution"),
)
"""The absolute paths a Harbor task's scripts use besides the workspace."""

MAX_OUTPUT_CHARS = 8000
"""What a `bash` call shows the model of its output: the head and the tail beyond this."""

_IGNORED = {"CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "MAINTAINER", "HEALTHCHECK", "STOPSIGNAL"}
_NETWORK_WORDS = re.compile(
    r"\b(apt-get|apt|apk|yum|dnf|curl|wget)\b"
    r"|\b(pip3?|uv pip|uv|npm|pnpm|yarn|poetry) (install|add|ci|sync)\b|\bgit clone\b"
)
_VAR = re.compile(r"\$(\w+)|\$\{(\w+)\}")


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
class CopyStep:
    """`COPY`/`ADD` of a file or directory of the build context into the workspace."""

    source: Path
    dest: str
    """Relative to the workspace."""


@dataclass(frozen=True, slots=True)
class RunStep:
    """A `RUN`, with the environment the Dockerfile had set by then."""

    line: int
    command: str
    env: dict[str, str]


@dataclass(frozen=True, slots=True)
class DockerfilePlan:
    """What building a Dockerfile's workspace in the sandbox takes, in order.

    Attributes:
        base: the `FROM` image (read, not pulled: the host's system stands in for it).
        workdir: the workspace's absolute path inside the sandbox.
        env: variables from `ENV` (and `[environment].env`), seen by the agent and the tests.
        steps: the copies and runs, in Dockerfile order.
    """

    base: str
    workdir: str
    env: dict[str, str]
    steps: list[CopyStep | RunStep] = field(default_factory=list)


def plan_dockerfile(path: Path, *, workdir: str | None = None) -> DockerfilePlan:
    """Read a Dockerfile into a `DockerfilePlan`, or refuse it in one line.

    Args:
        path: the Dockerfile; its directory is the build context.
        workdir: `[environment].workdir`, which overrides the Dockerfile's `WORKDIR`.

    Raises:
        ConfigError: "<path>:<line>: <INSTRUCTION> ...: why", for the first instruction the
            sandbox cannot honour.
    """
    context = path.parent.resolve()
    base: str | None = None
    current = "/"
    args: dict[str, str] = {}
    env: dict[str, str] = {}
    raw: list[tuple[int, str, str]] = []
    for number, line in _logical_lines(path):
        keyword, _, rest = line.partition(" ")
        raw.append((number, keyword.upper(), rest.strip()))

    def refuse(number: int, text: str, why: str) -> ConfigError:
        shown = text if len(text) <= 60 else text[:57] + "..."
        return ConfigError(f"{path}:{number}: {shown}: {why}")

    copies_and_runs: list[tuple[Path, str] | RunStep] = []
    for number, keyword, rest in raw:
        text = f"{keyword} {rest}".strip()
        if keyword == "FROM":
            if base is not None:
                raise refuse(number, text, "multi-stage builds cannot be honoured")
            words = rest.split()
            flags = [w for w in words if w.startswith("--")]
            if flags:
                raise refuse(number, text, f"{flags[0]} cannot be honoured")
            base = _expand(words[0], args) if words else ""
        elif keyword == "ARG":
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip().strip('"')
        elif keyword == "ENV":
            env.update(_env_pairs(rest, {**args, **env}))
        elif keyword == "WORKDIR":
            target = PurePosixPath(current) / _expand(rest.strip('"'), {**args, **env})
            if copies_and_runs and str(target) != current:
                raise refuse(number, text, "a second WORKDIR after COPY or RUN is not honoured")
            current = str(target)
        elif keyword in ("COPY", "ADD"):
            copies_and_runs.extend(_copies(number, keyword, rest, context, current, refuse, text))
        elif keyword == "RUN":
            if rest.startswith("--"):
                raise refuse(number, text, f"{rest.split()[0]} cannot be honoured")
            command = _exec_form(rest) or rest
            needs = _NETWORK_WORDS.search(command)
            if needs:
                raise refuse(number, text, f"needs the network ({needs[0]}); the sandbox has none")
            copies_and_runs.append(RunStep(number, command, dict(env)))
        elif keyword == "USER":
            if rest.split(":")[0] not in ("root", "0"):
                raise refuse(number, text, "only root is honoured (commands run as the caller)")
        elif keyword in _IGNORED:
            continue
        else:
            raise refuse(number, text, f"{keyword} cannot be honoured")
    if base is None:
        raise ConfigError(f"{path}: no FROM instruction")
    final = workdir or current
    if final == "/":
        raise ConfigError(f"{path}: no WORKDIR: the workspace needs a directory of its own")
    steps: list[CopyStep | RunStep] = []
    for step in copies_and_runs:
        if isinstance(step, RunStep):
            steps.append(step)
            continue
        source, dest = step
        try:
            relative = PurePosixPath(dest).relative_to(final)
        except ValueError:
            raise ConfigError(
                f"{path}: COPY to {dest} is outside the workspace {final}; only the "
                "workspace is honoured"
            ) from None
        steps.append(CopyStep(source, str(relative)))
    return DockerfilePlan(base=base, workdir=final, env=env, steps=steps)


def _logical_lines(path: Path) -> list[tuple[int, str]]:
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err}") from err
    out: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        out.append((start, " ".join(p for p in pending if p)))
        pending = []
    if pending:
        out.append((start, " ".join(pending)))
    return out


def _expand(text: str, values: dict[str, str]) -> str:
    return _VAR.sub(lambda m: values.get(m[1] or m[2], ""), text)


def _env_pairs(rest: str, values: dict[str, str]) -> dict[str, str]:
    words = shlex.split(rest)
    if words and "=" not in words[0]:  # legacy `ENV KEY value words`
        return {words[0]: _expand(" ".join(words[1:]), values)}
    pairs = {}
    for word in words:
        key, _, value = word.partition("=")
        pairs[key] = _expand(value, {**values, **pairs})
    return pairs


def _exec_form(rest: str) -> str | None:
    if not rest.startswith("["):
        return None
    try:
        argv = json.loads(rest)
    except ValueError:
        return None
    return shlex.join(str(a) for a in argv) if isinstance(argv, list) else None


def _copies(
    number: int,
    keyword: str,
    rest: str,
    context: Path,
    current: str,
    refuse: Callable[[int, str, str], ConfigError],
    text: str,
) -> list[tuple[Path, str]]:
    words = _exec_form(rest)
    parts = shlex.split(words if words is not None else rest)
    flags = [p for p in parts if p.startswith("--")]
    for flag in flags:
        if not flag.startswith(("--chown", "--chmod")):  # ownership is the caller's anyway
            raise refuse(number, text, f"{flag.split('=')[0]} cannot be honoured")
    parts = [p for p in parts if not p.startswith("--")]
    if len(parts) < 2:
        raise refuse(number, text, f"{keyword} needs a source and a destination")
    *sources, dest = parts
    target = PurePosixPath(current) / dest
    out = []
    for source in sources:
        if "://" in source:
            raise refuse(number, text, "a URL source needs the network; the sandbox has none")
        if keyword == "ADD" and re.search(r"\.(tar|tgz|tar\.\w+)$", source):
            raise refuse(number, text, "ADD's archive extraction is not honoured; use RUN tar")
        matches = sorted(context.glob(source)) if any(c in source for c in "*?[") else []
        paths = matches or [context / source]
        for p in paths:
            resolved = p.resolve()
            if not resolved.is_relative_to(context) or not resolved.exists():
                raise refuse(number, text, f"{source} is not in the build context {context}")
            into_dir = dest.endswith("/") or len(paths) > 1 or len(sources) > 1
            name = target / p.name if into_dir and not resolved.is_dir() else target
            out.append((resolved, str(name)))
    return out


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

    def backend(self, root: Path | None = None) -> BubblewrapBackend:
        """A bubblewrap backend with this task's workspace path and Harbor's mounts."""
        return BubblewrapBackend(workdir=self.plan.workdir, mounts=HARBOR_MOUNTS, root=root)


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
        backend: BubblewrapBackend | None = None,
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
        self.sandbox: BubblewrapSandbox | None = None
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
        assert isinstance(sandbox, BubblewrapSandbox)
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
            result = await self._sandbox().run(
                ["bash", "-c", command], timeout_s=limit, env=self.task.plan.env
            )
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
        await _copy_tree(self.task.path / "solution", sandbox.host_path("solution"))
        limit = self.task.agent_timeout_s or self.command_timeout_s
        env = {**self.task.plan.env, **self.task.solution_env}
        result = await sandbox.run(["bash", "/solution/solve.sh"], timeout_s=limit, env=env)
        verified = await self._verify(agent_timeout=False)
        info = {**verified.info, "solve_exit_code": result.exit_code}
        return verified.model_copy(update={"info": info})

    def _time_left(self) -> float | None:
        if self._agent_deadline is None:
            return None
        return self._agent_deadline - time.monotonic()

    def _sandbox(self) -> BubblewrapSandbox:
        if self.sandbox is None:
            raise EnvError(f"the sandbox of task {self.task.name} is gone")
        return self.sandbox

    async def _build(self, sandbox: BubblewrapSandbox) -> None:
        plan = self.task.plan
        deadline = time.monotonic() + self.task.build_timeout_s
        for step in plan.steps:
            if isinstance(step, CopyStep):
                target = sandbox.workdir / step.dest
                copy = _copy_tree if step.source.is_dir() else _copy_file
                await copy(step.source, target)
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

    async def _verify(self, *, agent_timeout: bool) -> ToolResult:
        sandbox = self._sandbox()
        verifier = sandbox.host_path("logs") / "verifier"
        await anyio.to_thread.run_sync(lambda: shutil.rmtree(verifier, ignore_errors=True))
        await anyio.Path(verifier).mkdir(parents=True)
        await _copy_tree(self.task.path / "tests", sandbox.host_path("tests"))
        env = {**self.task.plan.env, **self.task.verifier_env}
        try:
            result = await sandbox.run(
                ["bash", "/tests/test.sh"], timeout_s=self.task.verifier_timeout_s, env=env
            )
        except SandboxError as err:
            raise EnvError(
                f"the tests of {self.task.name} did not finish in "
                f"{self.task.verifier_timeout_s:g}s: the reward is unknown"
            ) from err
        rewards = await anyio.to_thread.run_sync(_read_rewards, verifier, self.task.name)
        reward = float(rewards.get("reward", next(iter(rewards.values()))))
        info = {"rewards": rewards, "test_exit_code": result.exit_code}
        if agent_timeout:
            info["agent_timeout"] = True
        text = "The tests ran." if not agent_timeout else "Time is up; the tests ran."
        return ToolResult(content=text, reward=reward, done=True, info=info)


def _read_rewards(verifier: Path, name: str) -> dict[str, float]:
    """Harbor's rules: reward.txt holds one number; else reward.json a number per key."""
    text_path, json_path = verifier / "reward.txt", verifier / "reward.json"
    try:
        if text_path.is_file():
            rewards: Any = {"reward": float(text_path.read_text())}
        elif json_path.is_file():
            rewards = json.loads(json_path.read_text())
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
    except (OSError, ValueError) as err:
        raise EnvError(f"the tests of {name} wrote an unreadable reward: {err}") from err


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
