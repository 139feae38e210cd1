"""What one episode sees (`GroupSpec`, `EpisodeContext`) and how its final record is made.

The driver runs episodes; this module holds the two things an episode author deals with,
the spec it was admitted from and the context it gets, and the one rule that turns what an
episode left behind (a trajectory, an error, a cancellation, quarantined leases) into its
final record (`final_record`). The context knows nothing of the driver that made it: it is
handed the resources scope and a callback that counts each turn recorded, which is all a
driver's counts need from it.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from .._exceptions import ConfigError
from ..trajectory import PolicyRef, Status, Trajectory, Turn
from ._lease import Lease, LeaseState
from ._pool import Pool
from ._resources import RolloutResources

__all__ = ["EpisodeContext", "GroupSpec", "final_record"]


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """What to admit: `size` episodes of one task.

    Attributes:
        task_id: names the task; every member's trajectory carries it.
        size: members of the group (GRPO samples per prompt).
        task: anything the episode needs (a prompt, a seed); passed as `ctx.task`.
        id: the group id; a fresh one when not given.
    """

    task_id: str
    size: int = 1
    task: Any = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ConfigError(f"group size must be at least 1, got {self.size}")


class EpisodeContext:
    """What an episode gets: its task, the policy and its sampler, and leases bound to it.

    Attributes:
        task, task_id, group_id, index: what to play and which member this is.
        group_size: how many members the group has (`GroupSpec.size`).
        policy: the policy the group was admitted under (a `PolicyRef`); pass it to
            `sampler.sample(policy=)`.
        trajectory: a fresh trajectory with the ids filled in; record turns on it.
        resources: the `RolloutResources` scope.
        turns_counted: turns recorded through `add_turn` (the driver counts the rest of
            the returned trajectory's turns when the episode ends).
    """

    __slots__ = (
        "_count_turn",
        "_leases",
        "group_id",
        "group_size",
        "index",
        "policy",
        "resources",
        "task",
        "task_id",
        "trajectory",
        "turns_counted",
    )

    def __init__(
        self,
        resources: RolloutResources,
        spec: GroupSpec,
        index: int,
        policy: PolicyRef,
        count_turn: Callable[[], None],
    ):
        self._count_turn = count_turn
        self._leases: list[Lease[Any]] = []
        self.turns_counted = 0
        self.resources = resources
        self.task = spec.task
        self.task_id = spec.task_id
        self.group_id = spec.id
        self.group_size = spec.size
        self.index = index
        self.policy = policy
        self.trajectory = Trajectory(task_id=spec.task_id, group_id=spec.id)

    @property
    def sampler(self) -> Any:
        """The policy client of the resources scope (`RolloutResources.sampler`)."""
        return self.resources.sampler

    @property
    def leases(self) -> tuple[Lease[Any], ...]:
        """Every lease this episode borrowed through `borrow()`."""
        return tuple(self._leases)

    @asynccontextmanager
    async def borrow(self, pool: Pool[Any] | str) -> AsyncIterator[Lease[Any]]:
        """Borrow from a pool (or the pool of that name) on behalf of this episode."""
        source = self.resources.pool(pool) if isinstance(pool, str) else pool
        async with source.borrow() as lease:
            self._leases.append(lease)
            yield lease

    def add_turn(self, turn: Turn) -> None:
        """Append a turn to `trajectory` and count it for turns/s."""
        self.trajectory.turns.append(turn)
        self.turns_counted += 1
        self._count_turn()


def final_record(
    ctx: EpisodeContext, result: Trajectory | None, error: Exception | None
) -> Trajectory:
    """The episode's final (settled) record: its status, ids, error and quarantined leases.

    - it returned `result`: its own status, `completed` when it set none; but `quarantined`
      when an operation on one of its leases did not settle, since what that operation did
      is unknown (a harness that caught a wall-clock cut still returns a trajectory). A
      lease quarantined only because its teardown failed leaves the record as it is;
    - it raised `error`: `failed`, with the error's type and message;
    - it was cancelled: `quarantined` if one of its leases was, else `cancelled`.

    An episode that settled its record itself (a harness does) gets a copy with the
    driver's additions, since a settled record is never changed.
    """
    quarantined = [lease for lease in ctx._leases if lease.state is LeaseState.QUARANTINED]
    traj = result if result is not None else ctx.trajectory
    updates: dict[str, Any] = {}
    if traj.task_id != ctx.task_id:
        updates["task_id"] = ctx.task_id
    if traj.group_id != ctx.group_id:
        updates["group_id"] = ctx.group_id
    if result is not None:
        unsettled = any(lease.unsettled for lease in quarantined)
        status = Status.QUARANTINED if unsettled else traj.status or Status.COMPLETED
    elif error is not None:
        status = Status.FAILED
        kind = type(error)
        updates["error"] = f"{kind.__module__}.{kind.__qualname__}: {error}"
    else:
        status = Status.QUARANTINED if quarantined else Status.CANCELLED
    if quarantined:
        updates["info"] = {
            **traj.info,
            "quarantined_leases": [
                {
                    "lease": lease.id,
                    "kind": lease.kind,
                    "remote_id": lease.remote_id,
                    "also_held": [ref.model_dump() for ref in lease.also_held],
                    "reason": lease.reason,
                }
                for lease in quarantined
            ],
        }
    if not traj.settled:
        traj.settle(status, **updates)
        return traj
    if status is not traj.status:
        updates["status"] = status
    return traj.model_copy(update=updates) if updates else traj
