"""The shard's side of `ShardedDriver`: what its factory builds, and the Ray actor that runs it.

Each shard is one `ShardActor` in a process of its own. Its `run` calls the user's factory
there, opens a `RolloutResources` scope and a `RolloutDriver`, and keeps them open for the
shard's whole life; the head's other calls (`admit`, `pull`, `step`, `set_policy`) run on
the same event loop beside it. What crosses back to the head is plain data: complete groups
as JSON, counts, and quarantine records, in `Batch` and `Final`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass
from typing import Any

import anyio

from .._exceptions import ConfigError, UsageError
from ..trajectory import PolicyRef, Status, Trajectory
from ._driver import RolloutDriver
from ._episode import EpisodeContext, GroupSpec
from ._pool import Pool
from ._report import QuarantineRecord
from ._resources import DEFAULT_EXIT_GRACE, ResourcesStatistics, RolloutResources

__all__ = ["Batch", "Counts", "Final", "ShardActor", "ShardFactory", "ShardSetup"]

Episode = Callable[[EpisodeContext], Awaitable[Trajectory]]


@dataclass(frozen=True, slots=True)
class ShardSetup:
    """What one shard runs with; the factory builds it inside the shard's process.

    Attributes:
        episode: `async def episode(ctx) -> Trajectory`, e.g. a harness's `play`.
        pools: the shard's pools (each its own `EnvPool(make_env)`, `HarnessPool(...)`).
        sampler: the shard's policy client (`ctx.sampler`), held as `RolloutResources` holds
            it: a factory that is an async context manager opens it before it yields the
            setup and closes it after the shard's scope has closed.
        exit_grace: the shard's `RolloutResources.exit_grace`.
    """

    episode: Episode
    pools: Sequence[Pool[Any]] = ()
    sampler: Any = None
    exit_grace: float = DEFAULT_EXIT_GRACE


ShardFactory = Callable[[int], "ShardSetup | AbstractAsyncContextManager[ShardSetup]"]
"""`make_shard(index)`: a `ShardSetup`, or an async context manager that yields one (to open
and close a sampler around the shard's run). Pickled to the shard's actor."""


@dataclass(frozen=True, slots=True)
class Counts:
    """A shard's counts, as its driver has them now (picklable, unlike `DriverStatistics`)."""

    pid: int
    cpu_s: float
    running: int
    settled: dict[Status, int]
    turns: int
    policy: PolicyRef
    leases: ResourcesStatistics


@dataclass(frozen=True, slots=True)
class Batch:
    """One reply to `pull`: complete groups (JSON), counts, and the report when it changed."""

    groups: list[str]
    counts: Counts
    records: list[QuarantineRecord] | None
    done: bool
    """The shard's driver has closed and every group has been pulled: no more batches."""


@dataclass(frozen=True, slots=True)
class Final:
    """What `run` returns once the shard's scope has closed."""

    counts: Counts
    records: list[QuarantineRecord]


class ShardActor:
    """The actor: one `RolloutResources` + `RolloutDriver`, driven by the head's calls.

    Every method is async, so Ray runs them all on the actor's one event loop: `run` owns
    the scope for the shard's whole life; the others admit, hand out and step it. Ray does
    not keep an async actor's calls in the order they were sent, so `step` is told how
    many `admit` calls came before it and a drain waits for them.
    """

    def __init__(self, index: int, factory: ShardFactory, policy: PolicyRef, run_id: str):
        self.index = index
        self._factory = factory
        self._policy = policy
        self._run_id = run_id
        self._driver: RolloutDriver | None = None
        self._resources: RolloutResources | None = None
        self._out: list[str] = []
        self._step = 0
        self._finished = False
        self._started = False
        self._failed: BaseException | None = None
        self._event: anyio.Event | None = None
        self._reported: tuple[int, int] | None = None
        self._admit_calls = 0

    def _changed(self) -> anyio.Event:
        if self._event is None:
            self._event = anyio.Event()
        return self._event

    def _wake(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def run(self) -> Final:
        """Build the shard, run its driver until it drains, close it; return what is left."""
        try:
            async with AsyncExitStack() as stack:
                made = self._factory(self.index)
                if isinstance(made, AbstractAsyncContextManager) or hasattr(made, "__aenter__"):
                    made = await stack.enter_async_context(made)  # type: ignore[arg-type]
                if not isinstance(made, ShardSetup):
                    raise ConfigError(
                        f"the shard factory returned {type(made).__name__}, not a ShardSetup"
                    )
                res = RolloutResources(
                    sampler=made.sampler,
                    pools=made.pools,
                    run_id=f"{self._run_id}-shard{self.index}",
                    exit_grace=made.exit_grace,
                )
                self._resources = await stack.enter_async_context(res)
                driver = RolloutDriver(
                    res, made.episode, policy=self._policy, max_groups_in_flight=None
                )
                async with driver:
                    self._driver = driver
                    self._apply_step()
                    self._started = True
                    self._wake()
                    async for group in driver.groups():
                        self._out.append(group.model_dump_json())
                        self._wake()
            assert self._resources is not None
            return Final(self._counts(), self._resources.quarantined())
        except BaseException as exc:
            self._failed = exc
            raise
        finally:
            self._finished = True
            self._wake()

    async def wait_ready(self) -> None:
        """Return once the shard takes groups; raise what stopped it from getting there."""
        while not self._started and not self._finished:
            await self._changed().wait()
        if self._failed is not None:
            raise self._failed
        if not self._started:
            raise UsageError(f"shard {self.index} ended before it opened")

    async def admit(self, items: list[tuple[GroupSpec, PolicyRef]]) -> list[str]:
        """Admit groups under the policy the head bound each to; return the ids refused."""
        driver = self._driver
        assert driver is not None
        self._admit_calls += 1
        self._wake()
        refused = []
        for spec, policy in items:
            if not driver.admitting:
                refused.append(spec.id)
                continue
            if policy != driver.policy:
                driver.set_policy(policy)
            driver.admit_nowait(spec)
        return refused

    async def set_policy(self, policy: PolicyRef) -> None:
        if self._driver is not None and policy.version >= self._driver.policy.version:
            self._driver.set_policy(policy)
        self._policy = policy

    async def step(self, step: int, after_admits: int = 0) -> None:
        """Bring the shard to Ctrl-C step `step` (1 drain, 2 cancel, 3 abort).

        A drain first waits for the `after_admits` admission calls the head sent before it,
        since their groups were admitted before admission closed. Cancel and abort act now:
        groups arriving after them are refused, and the head settles those as cancelled.
        """
        if step == 1:
            while self._admit_calls < after_admits and not self._finished:
                await self._changed().wait()
        self._step = max(self._step, step)
        self._apply_step()

    def _apply_step(self) -> None:
        driver = self._driver
        if driver is None or self._step == 0:
            return
        if self._step >= 3:
            driver.abort()
        elif self._step == 2:
            driver.cancel()
        else:
            driver.close_admission()

    async def pull(self, linger: float, timeout: float) -> Batch:
        """Complete groups, once there are some (or after `timeout`), with the counts."""
        with anyio.move_on_after(timeout):
            while not self._out and not self._finished:
                await self._changed().wait()
            if self._out and not self._finished:
                await anyio.sleep(linger)
        groups, self._out = self._out, []
        counts = self._counts()
        records = None
        key = (counts.leases.quarantined, counts.leases.may_exist)
        if key != self._reported and self._resources is not None:
            self._reported = key
            records = self._resources.quarantined()
        return Batch(groups, counts, records, done=self._finished and not self._out)

    def _counts(self) -> Counts:
        driver, res = self._driver, self._resources
        if driver is None or res is None:
            empty = ResourcesStatistics(0, 0, 0, 0, 0, ())
            return Counts(os.getpid(), time.process_time(), 0, {}, 0, self._policy, empty)
        s = driver.statistics()
        return Counts(
            os.getpid(),
            time.process_time(),
            s.running,
            dict(s.settled),
            s.turns,
            s.policy,
            s.leases,
        )
