"""`RolloutDriver`: runs episodes in a task group and hands back complete groups.

An episode is a user coroutine, `async def episode(ctx: EpisodeContext) -> Trajectory`. It
borrows leases through `ctx.borrow(pool)`, samples through `ctx.sampler`, records turns with
`ctx.add_turn` and returns the trajectory (by default `ctx.trajectory`). The driver settles
every member with a status:

- the episode returned: its own status, `completed` when it set none (or `truncated`);
- it raised: `failed`, with the error's type and message;
- it was cancelled and all its leases settled: `cancelled`;
- it was cancelled and one of its leases was quarantined: `quarantined`.

A group is admitted under the policy current at admission and is complete when every member
has settled; only complete groups come out of `groups()` and `collect()`, and each is written
to the sink and fsynced first, by the resources scope's writer task (groups that complete
together share one fsync), never on the event loop. `max_groups_in_flight` bounds groups
admitted but not yet handed out, so sampling runs at most that far ahead of training; nothing
is ever dropped for staleness.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
from anyio import CancelScope
from anyio.abc import TaskGroup

from .._exceptions import UsageError
from ..trajectory import Group, PolicyRef, Status, Trajectory
from ._admission import (
    DEFAULT_MAX_GROUPS_IN_FLIGHT,
    DriverBase,
    DriverState,
    EpisodeCounts,
    Stop,
)
from ._episode import EpisodeContext, GroupSpec, final_record
from ._handout import Handout
from ._resources import RolloutResources
from ._sink import JsonlSink

__all__ = ["RolloutDriver"]

Episode = Callable[["EpisodeContext"], Awaitable[Trajectory]]


class _GroupState:
    __slots__ = ("members", "policy", "settled", "spec")

    def __init__(self, spec: GroupSpec, policy: PolicyRef):
        self.spec = spec
        self.policy = policy
        self.members: list[Trajectory | None] = [None] * spec.size
        self.settled = 0


class RolloutDriver(DriverBase):
    """Runs episodes of admitted groups and yields complete groups.

    Args:
        resources: the open `RolloutResources` scope episodes borrow from.
        episode: `async def episode(ctx) -> Trajectory`.
        policy: the policy current now; `set_policy` moves it forward.
        max_groups_in_flight: most groups admitted and not yet handed out (None: no bound;
            use it only when nothing consumes `groups()`, e.g. a sink-only run).
        sink: where each complete group is written (fsynced) before it is handed out. If a
            write fails, `groups()`, `collect()` and the exit of the `async with` raise its
            error.

    Example::

        async with RolloutDriver(res, episode, policy=ref, sink=sink) as driver:
            async with anyio.create_task_group() as tg:
                tg.start_soon(admit_all, driver, specs)   # then driver.close_admission()
                async for group in driver.groups():
                    train(group)
    """

    def __init__(
        self,
        resources: RolloutResources,
        episode: Episode,
        *,
        policy: PolicyRef,
        max_groups_in_flight: int | None = DEFAULT_MAX_GROUPS_IN_FLIGHT,
        sink: JsonlSink | None = None,
    ):
        super().__init__(
            policy=policy,
            max_groups_in_flight=max_groups_in_flight,
            handout=Handout(resources.writer),
        )
        self.resources = resources
        self.sink = sink
        self._episode = episode
        self._tg: TaskGroup | None = None
        self._scopes: set[CancelScope] = set()
        self._running = self._turns = 0
        self._settled: dict[Status, int] = dict.fromkeys(Status, 0)

    def __repr__(self) -> str:
        return f"<RolloutDriver {self.state} running={self._running}>"

    # lifetime -------------------------------------------------------------------------------

    async def __aenter__(self) -> RolloutDriver:
        if self.state is not DriverState.UNOPENED:
            raise UsageError(f"driver is {self.state}; a driver opens once")
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self.state = DriverState.ADMITTING
        return self

    async def _close(self) -> None:
        """Wait for every episode to settle, then for their groups to reach the sink."""
        assert self._tg is not None
        try:
            # The body's own exception is not handed to the task group, which would wrap
            # it in an ExceptionGroup; it propagates unchanged once every episode settled.
            await self._tg.__aexit__(None, None, None)
        finally:
            with CancelScope(shield=True):  # groups of settled episodes reach the sink
                await self.wait_drained()
            self.state = DriverState.CLOSED
            self._handout.wake()

    # the driver's hooks -----------------------------------------------------------------------

    def _place(self, spec: GroupSpec, policy: PolicyRef) -> None:
        assert self._tg is not None
        state = _GroupState(spec, policy)
        self._admitted += spec.size
        self._running += spec.size
        for index in range(spec.size):
            ctx = EpisodeContext(self.resources, spec, index, policy, self._count_turn)
            self._tg.start_soon(self._run, state, ctx, name=f"episode {spec.id}/{index}")

    def _count_turn(self) -> None:
        self._turns += 1

    def _stopped(self, step: Stop) -> None:
        if step >= Stop.CANCEL:
            for scope in self._scopes:
                scope.cancel()

    def abort(self) -> None:
        """Cancel every episode and cut off every remote operation now (no settling)."""
        self.resources.abort()
        super().abort()

    def _busy(self) -> bool:
        return bool(self._running)

    def _episode_counts(self) -> EpisodeCounts:
        return EpisodeCounts(self._running, self._settled, self._turns, self.resources.statistics())

    # episodes ---------------------------------------------------------------------------------

    async def _run(self, state: _GroupState, ctx: EpisodeContext) -> None:
        result: Trajectory | None = None
        error: Exception | None = None
        scope = CancelScope()
        self._scopes.add(scope)
        try:
            with scope:
                if self.state is DriverState.CANCELLING:
                    scope.cancel()
                try:
                    result = await self._episode(ctx)
                except Exception as exc:
                    error = exc
                else:
                    if not isinstance(result, Trajectory):
                        error = UsageError(
                            f"the episode returned {type(result).__name__}, not a Trajectory"
                        )
                        result = None
        finally:
            self._scopes.discard(scope)
            self._finish(state, ctx, result, error)

    def _finish(
        self,
        state: _GroupState,
        ctx: EpisodeContext,
        result: Trajectory | None,
        error: Exception | None,
    ) -> None:
        traj = final_record(ctx, result, error)
        self._turns += len(traj.turns) - ctx.turns_counted
        self._settled[traj.status] += 1
        self._running -= 1
        state.members[ctx.index] = traj
        state.settled += 1
        spec = state.spec
        if state.settled == len(state.members):
            group = Group(
                id=spec.id,
                task_id=spec.task_id,
                size=spec.size,
                policy=state.policy,
                trajectories=[t for t in state.members if t is not None],
            )
            self._handout.add(group, self.sink)
        self._handout.wake()
