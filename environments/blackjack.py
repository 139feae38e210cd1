"""Blackjack in process: the `Env` the other two variants (OpenEnv, sandboxed) are checked against.

The rules live in `plies.environments._blackjack_game` (standard library only, so the same
file runs inside a sandbox); this module wraps them as an `Env` with the tools `hit` and
`stand`. Every observation and tool result carries `player_total`, `usable_ace` and
`dealer_up` in its `info`.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from plies import ToolError, UsageError

from ._blackjack_game import DECK, RULES, BlackjackGame, IllegalMove, draw, total, usable_ace
from ._env import Env, Observation, Task, ToolResult, tool

__all__ = [
    "DECK",
    "RULES",
    "BlackjackEnv",
    "BlackjackGame",
    "draw",
    "new_seed",
    "total",
    "usable_ace",
]


def new_seed() -> int:
    """A fresh deal seed for tasks that give none (recorded in `info["seed"]`)."""
    return secrets.randbits(63)


class BlackjackEnv(Env):
    """One hand of Blackjack against the dealer, played with the tools `hit` and `stand`.

    Example:
        ```python
        async with BlackjackEnv() as env:
            obs = await env.reset(Task(id="hand-7", seed=7))
            result = await env.call_tool("stand", {})
            print(result.reward, result.info["player_total"])
        ```
    """

    def __init__(self) -> None:
        super().__init__()
        self._game: BlackjackGame | None = None

    async def setup(self, task: Task) -> Observation:
        seed = new_seed() if task.seed is None else task.seed
        self._game = BlackjackGame.deal(seed)
        return Observation(
            messages=[{"role": "user", "content": self._game.opening()}], info=self._game.info()
        )

    @tool
    def hit(self) -> ToolResult:
        """Take another card. Going over 21 loses at once."""
        return self._move(self._require_game().hit)

    @tool
    def stand(self) -> ToolResult:
        """Keep your hand and end your turn; the dealer plays and the hand is scored."""
        return self._move(self._require_game().stand)

    def _move(self, move: Callable[[], str]) -> ToolResult:
        game = self._require_game()
        try:
            text = move()
        except IllegalMove as err:
            raise ToolError(str(err)) from None
        return ToolResult(content=text, reward=game.reward, done=game.done, info=game.info())

    def _require_game(self) -> BlackjackGame:
        if self._game is None:
            raise UsageError("reset the env before calling its tools")
        return self._game
