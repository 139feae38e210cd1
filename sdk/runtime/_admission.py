"""The driver contract, written once: admission, stopping, counts and the hand-out of groups.

`RolloutDriver` runs episodes in this process; `ShardedDriver` places them on Ray shards.
What a caller sees is the same for both, so it lives here once, in `DriverBase`:

- admission: `admit` / `admit_nowait` bind a group to the current policy and refuse past
  `max_groups_in_flight` groups admitted and not yet handed out (so sampling runs at most that
  far ahead of training); `set_policy` moves the policy forward only;
- stopping, in the three steps of Ctrl-C (`Stop`): `close_admission` (drain), `cancel`,
  `abort`, each applied once and never undone; `stop` and `wait_drained` wait for the drain;
- counts: `statistics()` returns one frozen `DriverStatistics` record, as pools and
  resources scopes do;
- results: `collect()` and `groups()` take complete groups from the `Handout`, each on disk
  first.

A driver supplies what differs as five hooks: where an admitted group runs (`_place`), what a
stop step does to what runs (`_stopped`), whether anything still runs (`_busy`), its episode
counts (`_episode_counts`) and how it closes once stopped (`_close`); the sharded one also
refuses admission when no shard is left (`_refusal`) and fans a new policy out
(`_policy_moved`). Leaving `async with` is the same for both: a clean exit drains, an error or a
cancellation cancels, then the driver closes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from types import MappingProxyType, TracebackType
from typing import NamedTuple

from anyio import WouldBlock

from .._exceptions import AdmissionClosed, ConfigError, UsageError
from ..trajectory import Group, PolicyRef, Status
from ._episode import GroupSpec
from ._handout import Handout
from ._resources import ResourcesStatistics

__all__ = [
    "DEFAULT_MAX_GROUPS_IN_FLIGHT",
    "DriverBase",
    "DriverState",
    "DriverStatistics",
    "EpisodeCounts",
    "Stop",
]

DEFAULT_MAX_GROUPS_IN_FLIGHT = 8


class DriverState(StrEnum):
    UNOPENED = "unopened"
    ADMITTING = "admitting"
    """Open and taking groups."""
    DRAINING = "draining"
    """Admission closed; episodes in flight run to their end."""
    CANCELLING = "cancelling"
    """Episodes in flight were cancelled; they settle or quarantine."""
    CLOSED = "closed"


class Stop(IntEnum):
    """The steps of stopping a driver, in the order Ctrl-C takes them; each only once."""

    DRAIN = 1
    """Admission closed; what runs goes on to its end."""
    CANCEL = 2
    """What runs is cancelled; remote operations get their pool's `settle_timeout`."""
    ABORT = 3
    """What runs is cancelled and every remote operation cut off now."""


@dataclass(frozen=True, slots=True)
class DriverStatistics:
    """What `statistics()` returns: episode and group counts, plus the lease accounting."""

    state: DriverState
    admitted_groups: int
    admitted: int
    """Episodes admitted."""
    running: int
    settled: MappingProxyType[Status, int]
    """Episodes with a final record, by status."""
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


class EpisodeCounts(NamedTuple):
    """A driver's own share of `DriverStatistics`: what its episodes are doing."""

    running: int
    settled: Mapping[Status, int]
    turns: int
    leases: ResourcesStatistics


class DriverBase:
    """Admission, stopping, counts and hand-out, as `RolloutDriver` and `ShardedDriver` share
    them; see the module docstring for the hooks a driver fills in.

    Args:
        policy: the policy current now; `set_policy` moves it forward.
        max_groups_in_flight: most groups admitted and not yet handed out (None: no bound).
        handout: where complete groups wait to be taken.
    """

    def __init__(
        self, *, policy: PolicyRef, max_groups_in_flight: int | None, handout: Handout
    ) -> None:
        if max_groups_in_flight is not None and max_groups_in_flight < 1:
            raise ConfigError(
                f"max_groups_in_flight must be at least 1 or None, got {max_groups_in_flight}"
            )
        self.max_groups_in_flight = max_groups_in_flight
        self.state = DriverState.UNOPENED
        self._policy = policy
        self._handout = handout
        self._stop: Stop | None = None
        self._admitted_groups = 0
        self._admitted = 0
        """Episodes admitted (a driver's `_place` counts them)."""

    # hooks ------------------------------------------------------------------------------------

    def _place(self, spec: GroupSpec, policy: PolicyRef) -> None:
        """Start (or queue) the admitted group's episodes under `policy`."""
        raise NotImplementedError

    def _stopped(self, step: Stop) -> None:
        """Apply `step` to what runs; the state is already set."""
        raise NotImplementedError

    def _busy(self) -> bool:
        """Something admitted has not come back as a complete group yet."""
        raise NotImplementedError

    def _episode_counts(self) -> EpisodeCounts:
        raise NotImplementedError

    async def _close(self) -> None:
        """Wait for what runs to stop (drained or cancelled, as `__aexit__` asked), write what
        came back, release what the driver holds and end `CLOSED`, whatever interrupts it."""
        raise NotImplementedError

    def _refusal(self) -> str | None:
        """Why no group can be admitted although admission is open, or None."""
        return None

    def _policy_moved(self, policy: PolicyRef) -> None:
        """The policy new groups are admitted under moved to `policy`."""

    # policy and admission ---------------------------------------------------------------------

    @property
    def policy(self) -> PolicyRef:
        """The policy new groups are admitted under."""
        return self._policy

    def set_policy(self, policy: PolicyRef) -> None:
        """Admit later groups under `policy`; groups already admitted keep theirs.

        Raises:
            ConfigError: the version goes backwards.
        """
        if policy.version < self._policy.version:
            raise ConfigError(
                f"policy version went back from {self._policy.version} to {policy.version}"
            )
        self._policy = policy
        self._policy_moved(policy)

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
            AdmissionClosed: the driver was stopped (or cannot run the group anywhere).
        """
        if self.state is DriverState.UNOPENED:
            raise UsageError(f"admit inside `async with {type(self).__name__}(...)`")
        if self.state is not DriverState.ADMITTING:
            raise AdmissionClosed(f"the driver is {self.state}; it takes no more groups")
        if (why := self._refusal()) is not None:
            raise AdmissionClosed(why)
        if (
            self.max_groups_in_flight is not None
            and self._admitted_groups - self._handout.handed_out >= self.max_groups_in_flight
        ):
            raise WouldBlock
        policy = self._policy
        self._admitted_groups += 1
        self._place(spec, policy)
        self._handout.wake()
        return Group(id=spec.id, task_id=spec.task_id, size=spec.size, policy=policy)

    # stopping ---------------------------------------------------------------------------------

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Drain (or, on an error or cancellation, cancel) what runs, then close.

        The body's own exception propagates unchanged; a body that ended cleanly sees the
        sink's failure instead, if writing a group failed.
        """
        if exc is None:
            self.close_admission()
        else:
            self.cancel()
        await self._close()
        if exc is None:
            self._handout.raise_error()

    def _escalate(self, step: Stop) -> None:
        """Bring the driver to `step`, once; a step already reached (or passed) does nothing."""
        if self.state in (DriverState.UNOPENED, DriverState.CLOSED):
            return
        if self._stop is not None and step <= self._stop:
            return
        self._stop = step
        self.state = DriverState.DRAINING if step is Stop.DRAIN else DriverState.CANCELLING
        self._stopped(step)
        self._handout.wake()

    def close_admission(self) -> None:
        """Take no more groups; episodes in flight run to their end."""
        self._escalate(Stop.DRAIN)

    def cancel(self) -> None:
        """Close admission and cancel every episode in flight.

        Each one's remote operations get their pool's `settle_timeout`; episodes end as
        `cancelled`, or `quarantined` when a lease could not be settled.
        """
        self._escalate(Stop.CANCEL)

    def abort(self) -> None:
        """Cancel every episode and cut off every remote operation now (no settling)."""
        self._escalate(Stop.ABORT)

    async def stop(self) -> None:
        """Close admission and wait until every admitted group has come back."""
        self.close_admission()
        await self.wait_drained()

    async def wait_drained(self) -> None:
        """Wait until no admitted group is out and every complete group is on disk."""
        while self._busy() or self._handout.writing:
            await self._handout.wait()

    # results ----------------------------------------------------------------------------------

    def statistics(self) -> DriverStatistics:
        """Counts now: admitted, running, settled by status, lease accounting."""
        counts = self._episode_counts()
        return DriverStatistics(
            state=self.state,
            admitted_groups=self._admitted_groups,
            admitted=self._admitted,
            running=counts.running,
            settled=MappingProxyType(dict(counts.settled)),
            groups_complete=self._handout.complete,
            groups_in_flight=self._admitted_groups - self._handout.handed_out,
            turns=counts.turns,
            policy=self._policy,
            leases=counts.leases,
        )

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
