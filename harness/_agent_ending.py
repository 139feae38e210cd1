"""`AgentEnding`: how an episode played by an agent program ends, and its session with it.

`AgentHarness` and `GatewayHarness` each run an agent program per episode behind a gateway
session, and settle it by the same rules (their module docstrings): an agent past its
wall-clock budget makes the episode `truncated`, one that exits non-zero makes it `failed`
with the tail of its output in `error`, and so does an error of its sandbox or env. A `failed`
episode keeps no reward (that is the system, not the model, and training refuses its group);
any other is scored by the harness's `RewardPolicy`. The rules live here once, so the two
harnesses cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plies.gateway import Gateway
from plies.trajectory import Status, Trajectory

from .rewards import RewardPolicy

__all__ = ["AgentEnding"]

_ERROR_TAIL = 800
"""Characters of a failed agent's output that the trajectory's `error` keeps."""


@dataclass(slots=True)
class AgentEnding:
    """The status and error of one episode so far: `completed` until something says otherwise."""

    status: Status = Status.COMPLETED
    error: str | None = None

    def truncated(self, limit: str) -> None:
        """The agent ran past `limit` (its budget, in words) and was killed."""
        self.status, self.error = Status.TRUNCATED, f"agent ran past {limit}"

    def exited(self, code: int | None, output: str) -> None:
        """The agent exited with `code` after writing `output`: a failure unless it is 0."""
        if code != 0:
            self.status = Status.FAILED
            self.error = f"agent exited with {code}: {output[-_ERROR_TAIL:]}"

    def failed(self, exc: Exception) -> None:
        """The agent's sandbox or env failed the episode with `exc`."""
        self.status, self.error = Status.FAILED, f"{type(exc).__name__}: {exc}"

    async def finish(
        self,
        gateway: Gateway,
        key: str,
        rewards: RewardPolicy,
        paid: float | None,
        info: dict[str, Any],
    ) -> Trajectory:
        """Finish session `key` into its trajectory: no reward when the episode failed, else
        what `rewards` makes of `paid` (what the env paid, None for nothing) as it ended."""
        reward = (
            None
            if self.status is Status.FAILED
            else rewards.score(paid, truncated=self.status is Status.TRUNCATED)
        )
        return await gateway.finish_session(
            key, reward=reward, status=self.status, error=self.error, info=info
        )
