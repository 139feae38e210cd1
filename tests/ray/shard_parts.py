"""What the Ray tests' shards run: episodes against a real loopback server (`op_server.py`).

Importable by the shards' actors (the factories are pickled by reference), so it imports
only plies, anyio and httpx.

- `StandInPolicy` samples from the server's `/sample` (a stand-in completion after a delay)
  and runs remote steps on its `/op`;
- `episode` borrows a `Session` (a resource with a remote id), then per turn samples,
  records the turn under the group's policy (`stand_in_turn`, shared with
  `tests/runtime/signal_script.py`) and runs one step inside `lease.operation`, so a
  cancelled step that does not settle quarantines the session;
- `placed_episode` is `episode` with the Ray node and process that played it in the
  trajectory's `info` (the two-node test checks where each shard ran);
- `make_shard(url, index)` is the factory a `ShardedDriver` pickles to each actor.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx

from plies import Trajectory, Turn
from plies.runtime import EnvPool, EpisodeContext, ShardSetup

TOKENS = 3
Episode = Callable[[EpisodeContext], Awaitable[Trajectory]]
SKIP = "the Ray tier needs the plies[ray] extra (.ci/ray-tier)"
"""Tests skip unless `ray.actor` imports: without Ray, `import ray` finds this folder."""


class StandInPolicy:
    """A policy client for the tests: the op server's stand-in completions."""

    def __init__(self, url: str, http: httpx.AsyncClient):
        self.url = url
        self.http = http

    async def sample(self, delay: float, sure: bool = False) -> dict[str, Any]:
        params = {"s": delay, "n": TOKENS, "sure": int(sure)}
        r = await self.http.get(f"{self.url}/sample", params=params)
        return r.raise_for_status().json()

    async def op(self, delay: float) -> None:
        (await self.http.get(f"{self.url}/op", params={"s": delay})).raise_for_status()


class Session:
    """A pooled resource with a remote id, so a quarantine report can name it."""

    remote_kind = "session"
    _ids = itertools.count(1)

    def __init__(self) -> None:
        self.remote_id = f"session-{os.getpid()}-{next(self._ids)}"

    async def aclose(self) -> None:
        await anyio.lowlevel.checkpoint()


async def make_session() -> Session:
    return Session()


def task(
    turns: int, sample_s: float = 0.01, step_s: float = 0.01, sure: bool = False
) -> dict[str, Any]:
    """An episode's work; `sure`: every token drawn with certainty (logprob 0)."""
    return {"turns": turns, "sample_s": sample_s, "step_s": step_s, "sure": sure}


def stand_in_turn(ctx: EpisodeContext, k: int, body: Mapping[str, Any]) -> Turn:
    """Turn `k` of an episode: the op server's stand-in completion `body` (its `/sample`
    answer) under the episode's policy, each turn after the first extending the one before."""
    return Turn(
        prompt_ids=[7, k],
        extends=k > 0,
        completion_ids=body["ids"],
        logprobs=body["logprobs"],
        finish_reason="stop",
        policy=ctx.policy,
    )


async def episode(ctx: EpisodeContext) -> Trajectory:
    async with ctx.borrow("env") as lease:
        for k in range(ctx.task["turns"]):
            body = await ctx.sampler.sample(ctx.task["sample_s"], ctx.task["sure"])
            ctx.add_turn(stand_in_turn(ctx, k, body))
            async with lease.operation("step"):
                await ctx.sampler.op(ctx.task["step_s"])
    return ctx.trajectory


async def placed_episode(ctx: EpisodeContext) -> Trajectory:
    import ray  # only ever runs in a shard's actor

    trajectory = await episode(ctx)
    trajectory.info.update(node=ray.get_runtime_context().get_node_id(), pid=os.getpid())
    return trajectory


def make_pool() -> EnvPool[Session]:
    return EnvPool(make_session, kind="session", limit=64, settle_timeout=0.3)


@asynccontextmanager
async def make_shard(url: str, index: int, play: Episode = episode) -> AsyncIterator[ShardSetup]:
    """One shard: its own HTTP client, policy client and pool."""
    async with httpx.AsyncClient(timeout=60) as http:
        yield ShardSetup(play, pools=[make_pool()], sampler=StandInPolicy(url, http), exit_grace=2)
