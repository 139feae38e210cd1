"""Blackjack played by a trusted game script inside a sandbox, one sandbox per episode.

The script is `plies.environments._blackjack_game` itself (standard library only), copied
into the sandbox at reset. Each tool call runs it once against a state file in the sandbox:

    python3 game.py state.json new SEED | hit | stand

so the sandbox holds the whole game, and the env holds only the sandbox. This is the shape of
any env whose tools must run untrusted-looking work somewhere else: create the sandbox in
`setup` and keep its handle at once, run commands in the tools, kill it in `teardown`, and
name it in `remote_refs` so that a failed teardown is reported with its id.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import anyio

from plies import SandboxError, ToolError
from plies.runtime import RemoteRef

from ._env import Env, Observation, Task, ToolResult, tool
from .blackjack import new_seed
from .sandbox import Sandbox, SandboxBackend, new_episode_id

__all__ = ["GAME_FILE", "STATE_FILE", "SandboxedBlackjackEnv", "game_script"]

GAME_FILE = "game.py"
STATE_FILE = "state.json"


def game_script() -> str:
    """The source of the trusted game script: the same rules the in-process env runs."""
    return resources.files("plies.environments").joinpath("_blackjack_game.py").read_text()


class SandboxedBlackjackEnv(Env):
    """Blackjack whose every move runs the game script in this episode's own sandbox.

    Args:
        backend: makes the sandbox (`LocalProcessBackend`, `E2BBackend`).
        run_id: names the run in the sandbox's labels.
        episode_id: names the episode; unique per env by default, because the members of a
            group share a task id but must never share a sandbox.
        python: the interpreter command inside the sandbox.
        command_timeout_s: for each run of the game script.

    Example:
        ```python
        async with SandboxedBlackjackEnv(LocalProcessBackend(), run_id="run-1") as env:
            obs = await env.reset(Task(id="hand-3", seed=3))
            result = await env.call_tool("hit", {})
        ```
    """

    def __init__(
        self,
        backend: SandboxBackend,
        *,
        run_id: str,
        episode_id: str | None = None,
        python: str = "python3",
        command_timeout_s: float = 30.0,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.run_id = run_id
        self.episode_id = episode_id
        self.python = python
        self.command_timeout_s = command_timeout_s
        self._sandbox: Sandbox | None = None

    @property
    def sandbox_id(self) -> str | None:
        """The remote id of this episode's sandbox while it exists."""
        return self._sandbox.id if self._sandbox is not None else None

    def remote_refs(self) -> list[RemoteRef]:
        if self._sandbox is None:
            return []
        detail = {"run_id": self.run_id, "episode_id": self.episode_id or ""}
        return [RemoteRef(kind=self._sandbox.kind, id=self._sandbox.id, detail=detail)]

    async def setup(self, task: Task) -> Observation:
        self.episode_id = self.episode_id or new_episode_id(task.id)
        # Shielded so that a cancelled reset still records the sandbox it made: teardown
        # must know every sandbox that exists.
        with anyio.CancelScope(shield=True):
            self._sandbox = await self.backend.create(
                run_id=self.run_id, episode_id=self.episode_id
            )
        await self._sandbox.write_file(GAME_FILE, game_script())
        seed = new_seed() if task.seed is None else task.seed
        step = await self._play("new", str(seed))
        return Observation(messages=[{"role": "user", "content": step["text"]}], info=step["info"])

    async def teardown(self) -> None:
        sandbox = self._sandbox
        if sandbox is not None:
            await sandbox.kill()  # raises SandboxError if the kill cannot be confirmed
            self._sandbox = None

    @tool
    async def hit(self) -> ToolResult:
        """Take another card. Going over 21 loses at once."""
        return self._result(await self._play("hit"))

    @tool
    async def stand(self) -> ToolResult:
        """Keep your hand and end your turn; the dealer plays and the hand is scored."""
        return self._result(await self._play("stand"))

    async def _play(self, *move: str) -> dict[str, Any]:
        sandbox = self._sandbox
        if sandbox is None:
            raise SandboxError("the sandbox is gone")
        argv = [self.python, GAME_FILE, STATE_FILE, *move]
        result = await sandbox.run(argv, timeout_s=self.command_timeout_s)
        if result.exit_code == 2:  # the script refused the move
            raise ToolError(_script_error(result.stderr))
        if result.exit_code != 0:
            raise SandboxError(
                f"the game script failed with exit code {result.exit_code}: "
                f"{result.stderr.strip()[-500:]}",
                sandbox_id=sandbox.id,
            )
        try:
            step = json.loads(result.stdout)
            _ = step["text"], step["reward"], step["done"], step["info"]
        except (ValueError, KeyError, TypeError) as err:
            raise SandboxError(
                f"the game script printed something unreadable: {result.stdout[:200]!r}",
                sandbox_id=sandbox.id,
            ) from err
        return step

    @staticmethod
    def _result(step: dict[str, Any]) -> ToolResult:
        return ToolResult(
            content=step["text"],
            reward=float(step["reward"]),
            done=bool(step["done"]),
            info=step["info"],
        )


def _script_error(stderr: str) -> str:
    try:
        return str(json.loads(stderr)["error"])
    except (ValueError, KeyError, TypeError):
        return stderr.strip() or "the move was refused"
