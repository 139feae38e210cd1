"""An env that costs nothing, for the tests of the driver's own parts (pacing, sinks, display).

With a resource that is free to create and close and an episode that only borrows it for a
moment, what such a test sees is the driver's bookkeeping, not an environment's.
"""

from __future__ import annotations

import anyio

from plies import PolicyRef, Trajectory
from plies.runtime import EpisodeContext

REF = PolicyRef(uri="plies://test/policies/0", version=0)


class Thing:
    """The env resource: nothing to start, nothing to stop."""

    async def aclose(self) -> None:
        await anyio.lowlevel.checkpoint()


async def make() -> Thing:
    """`EnvPool`'s factory of `Thing`s."""
    return Thing()


async def quick(ctx: EpisodeContext) -> Trajectory:
    """An episode that holds its env for 10 ms and records no turn."""
    async with ctx.borrow("env"):
        await anyio.sleep(0.01)
    return ctx.trajectory
