"""`Harness`: what every agent loop offers a driver, so that any harness feeds any driver.

A harness plays one episode of a `RolloutDriver`: it borrows what it needs through the
episode's context, plays `ctx.task` and returns the settled trajectory. `ToolCallingHarness`
samples the policy itself; `GatewayHarness` and `AgentHarness` let an agent program sample it
through a gateway session. `play_groups` and a driver's episode function take any of them.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from plies.runtime import EpisodeContext, Pool
from plies.trajectory import Trajectory

__all__ = ["Harness"]


@runtime_checkable
class Harness(Protocol):
    """Plays driver episodes.

    Attributes:
        policy: the policy client its turns are sampled from (the one the driver's
            `RolloutResources` should hold).

    Example::

        async def episode(ctx: EpisodeContext) -> Trajectory:
            return await harness.play(ctx, pool="env")
    """

    @property
    def policy(self) -> Any: ...

    async def play(self, ctx: EpisodeContext, *, pool: Pool[Any] | str = "env") -> Trajectory:
        """Borrow an env from `pool` for `ctx`, play `ctx.task` on it, return the record."""
        ...
