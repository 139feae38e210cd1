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
"""

from __future__ import annotations

from typing import Any

import anyio

from plies import ConfigError
from plies.environments import Env, Observation, Sandbox, SandboxBackend, Task
from plies.runtime import RemoteRef

__all__ = ["DEFAULT_VERIFY_TIMEOUT_S", "WorkspaceEnv"]

DEFAULT_VERIFY_TIMEOUT_S = 60.0
"""Seconds the verifier may run before the reward is refused as unknown (a `SandboxError`)."""


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
