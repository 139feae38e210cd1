"""`RolloutDriver`: runs episodes in a task group and hands back complete groups.

An episode is a user coroutine, `async def episode(ctx: EpisodeContext) -> Trajectory`. It
borrows leases through `ctx.borrow(pool)`, samples through `ctx.policy`, records turns with
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

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType, TracebackType

import anyio
from anyio import CancelScope, WouldBlock
from anyio.abc import TaskGroup

from .._exceptions import AdmissionClosed, ConfigError, UsageError
from ..trajectory import Group, PolicyRef, Status, Trajectory
from ._episode import EpisodeContext, GroupSpec, settle_episode
from ._handout import Handout
from ._resources import ResourcesStatistics, RolloutResources
from ._sink import JsonlSink

__all__ = ["DriverState", "DriverStatistics", "RolloutDriver"]

DEFAULT_MAX_GROUPS_IN_FLIGHT = 8

Episode = Callable[["EpisodeContext"], Awaitable[Trajectory]]


class DriverState(StrEnum):
    UNOPENED = "unopened"
    ADMITTING = "admitting"
    """Open and taking groups."""
    DRAINING = "draining"
    """Admission closed; episodes in flight run to their end."""
    CANCELLING = "cancelling"
    """Episodes in flight were cancelled; they settle or quarantine."""
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class DriverStatistics:
    """What `poll()` returns: episode and group counts, plus the lease accounting."""

    state: DriverState
    admitted_groups: int
    admitted: int
    """Episodes admitted."""
    running: int
    settled: MappingProxyType[Status, int]
    """Settled episodes by status."""
    groups_complete: int
    groups_in_flight: int
    """Admitted and not yet handed out by `groups()` / `collect()`."""
    turns: int
    policy: PolicyRef
    leases: ResourcesStatistics

    @property
    def quarantined(self) -> int:
        """Leases quarantined so far."""
        return self.leases.quarantined

    @property
    def settled_total(self) -> int:
        return sum(self.settled.values())


class _GroupState:
    __slots__ = ("members", "policy", "settled", "spec")

    def __init__(self, spec: GroupSpec, policy: PolicyRef):
        self.spec = spec
        self.policy = policy
        self.members: list[Trajectory | None] = [None] * spec.size
        self.settled = 0


class DriverBase:
    """What `RolloutDriver` and `ShardedDriver` do alike: the policy new groups are admitted
    under, which only moves forward, and `collect` / `groups()` over a `Handout`.
    """

    state: DriverState
    _policy: PolicyRef
    _handout: Handout
    _admitted_groups: int

    @property
    def policy(self) -> PolicyRef:
        """The policy new groups are admitted under."""
        return self._policy

    def _advance_policy(self, policy: PolicyRef) -> None:
        if policy.version < self._policy.version:
            raise ConfigError(
                f"policy version went back from {self._policy.version} to {policy.version}"
            )
        self._policy = policy

    def collect(self) -> list[Group]:
        """Hand out every complete group not yet handed out.

        Raises:
            OSError: writing a group to the sink failed.
        """
        return self._handout.take()

    async def groups(self) -> AsyncIterator[Group]:
        """Yield complete groups as they complete.

        Ends once admission is closed and every admitted group has been handed out.

        Raises:
            OSError: writing a group to the sink failed.
        """
        if self.state is DriverState.UNOPENED:
            raise UsageError(f"iterate groups() inside `async with {type(self).__name__}(...)`")
        async for group in self._handout.stream(self._all_handed_out):
            yield group

    def _all_handed_out(self) -> bool:
        return (
            self.state is not DriverState.ADMITTING
            and self._handout.handed_out == self._admitted_groups
        )


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
        if max_groups_in_flight is not None and max_groups_in_flight < 1:
            raise ConfigError(
                f"max_groups_in_flight must be at least 1 or None, got {max_groups_in_flight}"
            )
        self.resources = resources
        self.sink = sink
        self.max_groups_in_flight = max_groups_in_flight
        self.state = DriverState.UNOPENED
        self._episode = episode
        self._policy = policy
        self._tg: TaskGroup | None = None
        self._scopes: set[CancelScope] = set()
        self._handout = Handout(resources.writer)
        self._admitted_groups = self._admitted = self._running = self._turns = 0
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

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Drain (or, on an error or cancellation, cancel) what runs, then close."""
        if exc is None:
            self.close_admission()
        else:
            self.cancel()
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
        if exc is None:
            self._handout.raise_error()

    # policy and admission -------------------------------------------------------------------

    def set_policy(self, policy: PolicyRef) -> None:
        """Admit later groups under `policy`; groups already admitted keep theirs.

        Raises:
            ConfigError: the version goes backwards.
        """
        self._advance_policy(policy)

    @property
    def admitting(self) -> bool:
        return self.state is DriverState.ADMITTING

    async def admit(self, spec: GroupSpec) -> Group:
        """Admit a group once fewer than `max_groups_in_flight` are in flight.

        Returns:
            The (empty) `Group`, bound to the current policy.

        Raises:
            AdmissionClosed: the driver was stopped, before or while waiting.
        """
        while True:
            try:
                return self.admit_nowait(spec)
            except WouldBlock:
                await self._handout.wait()

    def admit_nowait(self, spec: GroupSpec) -> Group:
        """Admit a group now.

        Raises:
            WouldBlock: `max_groups_in_flight` groups are in flight.
            AdmissionClosed: the driver was stopped.
        """
        if self.state is DriverState.UNOPENED:
            raise UsageError("admit inside `async with RolloutDriver(...)`")
        if self.state is not DriverState.ADMITTING:
            raise AdmissionClosed(f"the driver is {self.state}; it takes no more groups")
        if (
            self.max_groups_in_flight is not None
            and self._admitted_groups - self._handout.handed_out >= self.max_groups_in_flight
        ):
            raise WouldBlock
        state = _GroupState(spec, self._policy)
        self._admitted_groups += 1
        self._start(state, range(1 if spec.deterministic else spec.size))
        self._handout.wake()
        return Group(id=spec.id, task_id=spec.task_id, size=spec.size, policy=state.policy)

    def _start(self, state: _GroupState, members: range) -> None:
        assert self._tg is not None
        spec = state.spec
        self._admitted += len(members)
        self._running += len(members)
        for index in members:
            ctx = EpisodeContext(self, spec, index, state.policy)
            self._tg.start_soon(self._run, state, ctx, name=f"episode {spec.id}/{index}")

    # stopping ---------------------------------------------------------------------------------

    def close_admission(self) -> None:
        """Take no more groups; episodes in flight run to their end."""
        if self.state is DriverState.ADMITTING:
            self.state = DriverState.DRAINING
            self._handout.wake()

    async def stop(self) -> None:
        """Close admission and wait until every admitted episode has settled."""
        self.close_admission()
        await self.wait_drained()

    async def wait_drained(self) -> None:
        """Wait until no episode runs and every complete group is on disk."""
        while self._running or self._handout.writing:
            await self._handout.wait()

    def cancel(self) -> None:
        """Close admission and cancel every episode in flight.

        Each one's remote operations get their pool's `settle_timeout`; episodes settle as
        `cancelled`, or `quarantined` when a lease could not be settled.
        """
        self.close_admission()
        if self.state in (DriverState.ADMITTING, DriverState.DRAINING):
            self.state = DriverState.CANCELLING
        for scope in self._scopes:
            scope.cancel()
        self._handout.wake()

    def abort(self) -> None:
        """Cancel every episode and cut off every remote operation now (no settling)."""
        self.resources.abort()
        self.cancel()

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
            self._settle(state, ctx, result, error)

    def _settle(
        self,
        state: _GroupState,
        ctx: EpisodeContext,
        result: Trajectory | None,
        error: Exception | None,
    ) -> None:
        traj = settle_episode(ctx, result, error)
        self._turns += len(traj.turns) - ctx._counted
        self._settled[traj.status] += 1
        self._running -= 1
        state.members[ctx.index] = traj
        state.settled += 1
        spec = state.spec
        if spec.deterministic and state.settled == 1 < spec.size:
            if not _certain(traj):
                self._start(state, range(1, spec.size))  # cancelled ones settle at once
                return
            state.members = [traj]  # the others would repeat it token for token
        if state.settled == len(state.members):
            group = Group(
                id=spec.id,
                task_id=spec.task_id,
                size=len(state.members),
                policy=state.policy,
                trajectories=[t for t in state.members if t is not None],
            )
            self._handout.add(group, self.sink)
        self._handout.wake()

    # results ----------------------------------------------------------------------------------

    def poll(self) -> DriverStatistics:
        """Counts now: admitted, running, settled by status, lease accounting."""
        return DriverStatistics(
            state=self.state,
            admitted_groups=self._admitted_groups,
            admitted=self._admitted,
            running=self._running,
            settled=MappingProxyType(dict(self._settled)),
            groups_complete=self._handout.complete,
            groups_in_flight=self._admitted_groups - self._handout.handed_out,
            turns=self._turns,
            policy=self._policy,
            leases=self.resources.statistics(),
        )


def _certain(traj: Trajectory) -> bool:
    """The episode completed and drew every token with certainty (logprob exactly 0)."""
    return (
        traj.status is Status.COMPLETED
        and bool(traj.turns)
        and all(lp == 0.0 for turn in traj.turns for lp in turn.logprobs)
    )
