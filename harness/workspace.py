"""`WorkspaceEnv`: an episode whose world is a sandbox directory, scored after the agent left.

An agent program such as Claude Code or Codex brings its own tools (a shell, file edits): the
env does not offer any. It makes one sandbox per episode, lays the task's files in it, states
the task as the opening user message, and once the agent has exited it runs a verifier in the
same sandbox to find the reward. The default reads all of that from `Task.data`:

- `instruction` (str): what the agent is asked to do;
- `files` (dict of relative path -> text): written into the workspace at reset;
- `verify` (list of str): a command run in the workspace after the agent exits; reward 1.0 if
  it exits 0, else 0.0 (override `verify` for graded rewards).

Subclass it to lay out a repository, grade partial credit or read a verifier's JSON.

`AgentEnv` says what `AgentHarness` needs of an env, so that envs of other kinds whose world is
a sandbox (a Harbor task's `HarborEnv`) are played by agent programs too.

`McpWorkspaceEnv` lets an agent program play any plies `Env` that has tools: the env's tools
are served to the agent over MCP for the episode (`EnvMcpServer`, behind a token), its opening
messages are the agent's instruction, and the reward is what the agent's tool calls earned.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from typing import Any, Protocol

import anyio

from plies import ConfigError
from plies.environments import Env, McpServer, Observation, SandboxBackend, Task
from plies.environments.mcp_server import EnvMcpServer
from plies.environments.sandbox import Sandbox
from plies.runtime import RemoteRef

__all__ = ["DEFAULT_VERIFY_TIMEOUT_S", "AgentEnv", "McpWorkspaceEnv", "WorkspaceEnv"]

DEFAULT_VERIFY_TIMEOUT_S = 60.0
"""Seconds the verifier may run before the reward is refused as unknown (a `SandboxError`)."""


class AgentEnv(Protocol):
    """An env an agent program works in: reset, run in its sandbox, then verify.

    Attributes:
        workspace: the episode's sandbox, once reset; the agent runs in its working directory.
        agent_timeout_s: the env's own limit on the agent's time, if it has one (the harness
            takes the smaller of it and its `wall_s`).
    """

    @property
    def workspace(self) -> Sandbox: ...

    @property
    def agent_timeout_s(self) -> float | None: ...

    def serve_tools(self) -> AbstractAsyncContextManager[Mapping[str, McpServer]]:
        """The MCP servers the agent is given, by name, served while the agent runs.

        Entered and left in the harness's own task, around the agent's run (a server's tasks
        must end in the task that started them, and an env may be closed in another).
        """
        ...

    async def reset(self, task: Task) -> Observation: ...

    async def verify(self) -> float:
        """The reward, read from the workspace after the agent exited."""
        ...


class WorkspaceEnv(Env):
    """One sandbox per episode for an agent that works with its own tools.

    Args:
        backend: makes the sandbox (`LocalProcessBackend`, `E2BBackend`).
        run_id: names the run in the sandbox's labels.
        verify_timeout_s: how long the verifier may run.

    Example::

        task = Task(id="greet", data={
            "instruction": "Write hello.txt containing 'hello'.",
            "verify": ["grep", "-qx", "hello", "hello.txt"],
        })
        async with WorkspaceEnv(LocalProcessBackend(), run_id="run-1") as env:
            obs = await env.reset(task)
            ...  # an agent works in env.workspace
            reward = await env.verify()
    """

    agent_timeout_s: float | None = None
    """No limit of its own: the harness's `wall_s` decides."""

    def serve_tools(self) -> AbstractAsyncContextManager[Mapping[str, McpServer]]:
        """None: the agent works with its own tools."""
        return nullcontext({})

    def __init__(
        self,
        backend: SandboxBackend,
        *,
        run_id: str,
        verify_timeout_s: float = DEFAULT_VERIFY_TIMEOUT_S,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.run_id = run_id
        self.verify_timeout_s = verify_timeout_s
        self.task: Task | None = None
        self._sandbox: Sandbox | None = None

    @property
    def workspace(self) -> Sandbox:
        """This episode's sandbox.

        Raises:
            ConfigError: the env was not reset yet, or was torn down.
        """
        if self._sandbox is None:
            raise ConfigError(f"{type(self).__name__} has no workspace before reset")
        return self._sandbox

    def remote_refs(self) -> list[RemoteRef]:
        if self._sandbox is None:
            return []
        return [
            RemoteRef(kind=self._sandbox.kind, id=self._sandbox.id, detail={"run": self.run_id})
        ]

    def instruction(self, task: Task) -> str:
        """What the agent is asked to do; the default is `task.data["instruction"]`."""
        text = task.data.get("instruction")
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"task {task.id!r} needs data['instruction'], a non-empty string")
        return text

    async def prepare(self, task: Task) -> None:
        """Lay the task out in the workspace; the default writes `task.data["files"]`."""
        files: Any = task.data.get("files", {})
        if not isinstance(files, dict):
            raise ConfigError(f"task {task.id!r}: data['files'] must map paths to text")
        for path, text in files.items():
            await self.workspace.write_file(str(path), str(text))

    async def setup(self, task: Task) -> Observation:
        self.task = task
        instruction = self.instruction(task)
        # Shielded so that a cancelled reset still records the sandbox it made: teardown
        # must know every sandbox that exists.
        with anyio.CancelScope(shield=True):
            self._sandbox = await self.backend.create(run_id=self.run_id, episode_id=task.id)
        await self.prepare(task)
        return Observation(messages=[{"role": "user", "content": instruction}])

    async def verify(self) -> float:
        """The reward, read from the workspace after the agent exited.

        The default runs `task.data["verify"]` there: 1.0 when it exits 0, else 0.0; a task
        without a verifier is worth 0.0.

        Raises:
            SandboxError: the verifier could not run or outlived `verify_timeout_s`.
        """
        task = self.task
        if task is None:
            raise ConfigError(f"{type(self).__name__}.verify before reset")
        command = task.data.get("verify")
        if command is None:
            return 0.0
        if not isinstance(command, list) or not all(isinstance(a, str) for a in command):
            raise ConfigError(f"task {task.id!r}: data['verify'] must be a command (list of str)")
        result = await self.workspace.run(command, timeout_s=self.verify_timeout_s)
        return 1.0 if result.exit_code == 0 else 0.0

    async def teardown(self) -> None:
        sandbox = self._sandbox
        if sandbox is not None:
            await sandbox.kill()  # raises SandboxError if the kill cannot be confirmed
            self._sandbox = None


class McpWorkspaceEnv(WorkspaceEnv):
    """An agent program plays `env` through its tools, served to it over MCP.

    Per episode: `env` is reset with the task; while the agent runs, its tools are served by
    an `EnvMcpServer` on loopback (behind a token made for the episode) and offered to the
    agent as the MCP server `server_name`; the agent works in a scratch sandbox of `backend`
    and is told the env's opening messages. The reward is what its tool calls earned
    (`EnvMcpServer.reward`). Closing this env closes `env` and removes the sandbox.

    Args:
        env: a fresh env with tools (single-use, as every env); this one owns it from now on.
        backend: makes the scratch sandbox the agent runs in.
        run_id: names the run in the sandbox's labels.
        server_name: the MCP server's name, under which agents list its tools (Claude Code
            and Codex call them `mcp__<name>__<tool>`).

    Example::

        async with McpWorkspaceEnv(BlackjackEnv(), LocalProcessBackend(), run_id="r") as env:
            trajectory = await AgentHarness(server, ClaudeCode(...)).run(env, Task(id="h", seed=3))
    """

    def __init__(
        self,
        env: Env,
        backend: SandboxBackend,
        *,
        run_id: str,
        server_name: str = "plies",
    ) -> None:
        if not isinstance(env, Env):
            raise ConfigError(f"McpWorkspaceEnv serves a plies Env, got {type(env).__name__}")
        super().__init__(backend, run_id=run_id)
        self.env = env
        self.server_name = server_name
        self.server: EnvMcpServer | None = None
        self._opening: Observation | None = None

    def instruction(self, task: Task) -> str:
        """The env's opening messages, in order, as one text."""
        assert self._opening is not None
        return "\n\n".join(str(m.get("content", "")) for m in self._opening.messages)

    async def prepare(self, task: Task) -> None:
        """Nothing to lay out: the agent's world is the env behind its tools."""

    async def setup(self, task: Task) -> Observation:
        self._opening = await self.env.reset(task)
        return await super().setup(task)

    @asynccontextmanager
    async def serve_tools(self) -> AsyncIterator[Mapping[str, McpServer]]:
        """`env`'s tools over MCP while the agent runs; each call's result is kept."""
        if self._opening is None:
            raise ConfigError("McpWorkspaceEnv serves no tools before reset")
        async with EnvMcpServer(self.env, name=self.server_name) as server:
            self.server = server
            yield {self.server_name: McpServer.http(server.url, headers=server.headers)}

    async def verify(self) -> float:
        """What the agent's tool calls earned (nothing if it never ran)."""
        return 0.0 if self.server is None else self.server.reward

    def remote_refs(self) -> list[RemoteRef]:
        return [*super().remote_refs(), *self.env.remote_refs()]

    async def teardown(self) -> None:
        try:
            await self.env.close()
        finally:
            await super().teardown()
