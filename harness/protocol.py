"""`Harness`: what every agent loop offers a driver, so that any harness feeds any driver.

A harness plays one episode of a `RolloutDriver`: it borrows what it needs through the
episode's context, plays `ctx.task` and returns the settled trajectory. `ToolCallingHarness`
samples the policy itself; `GatewayHarness` and `AgentHarness` let an agent program sample it
through a gateway session. `play_groups` and a driver's episode function take any of them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from typing import Any, Protocol, runtime_checkable

import anyio

from plies import ConfigError
from plies.environments import Task
from plies.gateway import Gateway
from plies.runtime import EpisodeContext, Lease, Pool
from plies.trajectory import Trajectory

__all__ = ["Harness", "gateway_session", "operation", "play_task"]


@runtime_checkable
class Harness(Protocol):
    """Plays driver episodes.

    Attributes:
        sampler: the policy client its turns are sampled from (the one the driver's
            `RolloutResources` should hold).

    Example::

        async def episode(ctx: EpisodeContext) -> Trajectory:
            return await harness.play(ctx, pool="env")
    """

    @property
    def sampler(self) -> Any: ...

    async def play(self, ctx: EpisodeContext, *, pool: Pool[Any] | str = "env") -> Trajectory:
        """Borrow an env from `pool` for `ctx`, play `ctx.task` on it, return the record."""
        ...


async def play_task(harness: Any, ctx: EpisodeContext, pool: Pool[Any] | str) -> Trajectory:
    """The `play` of a harness whose `run(env, task, *, group_id, lease)` plays a `Task` on
    an env: borrow one from `pool` and run `ctx.task` on it.

    Raises:
        ConfigError: `ctx.task` is not a `Task`.
    """
    if not isinstance(ctx.task, Task):
        raise ConfigError(
            f"{type(harness).__name__}.play needs GroupSpec.task to be a Task, got "
            f"{type(ctx.task).__name__}"
        )
    async with ctx.borrow(pool) as lease:
        return await harness.run(lease.resource, ctx.task, group_id=ctx.group_id, lease=lease)


def operation(lease: Lease[Any] | None, name: str) -> AbstractAsyncContextManager[Any]:
    """`lease.operation(name)`, or nothing for an env that was not borrowed (`run` called
    directly), so a harness's remote calls read the same either way."""
    return lease.operation(name) if lease is not None else nullcontext()


@asynccontextmanager
async def gateway_session(
    gateway: Gateway, task_id: str, *, group_id: str, info: dict[str, Any]
) -> AsyncIterator[str]:
    """A gateway session for one episode, its key yielded; the body ends it with
    `finish_session`.

    A body cancelled or broken before the finish leaves no half-recorded trajectory: the
    session is dropped, unrecorded, shielded so that a cancelled caller still drops it.
    """
    key = await gateway.create_session(task_id, group_id=group_id, info=info)
    try:
        yield key
    finally:
        if gateway.has_session(key):
            with anyio.CancelScope(shield=True):
                await gateway.drop_session(key)
