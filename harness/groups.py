"""Groups of episodes: `EnvGroup` makes and scores one group, `play_groups` plays several.

GRPO compares the members of a group, so the group is the unit that is made, scored and
cleaned up. An `EnvGroup` owns one group: the task every member plays, a fresh env per
member, rewards that depend on the whole group (a pairwise judge, a rank among members), and
whatever the members share, released once when the last of them has settled. It is the
plies form of tinker-cookbook's `EnvGroupBuilder`, with one env made per borrow so that each
member's env is torn down, or quarantined, through the runtime like any other lease.

`play_groups` is the short way from an env to trainable groups: it opens the resources
scope, gives each group its own pool, runs every member through a `Harness`, adds
the group rewards, runs the cleanup and returns the groups, ready for `training_groups`. A
long run that trains while it samples uses `RolloutDriver` directly, as the Blackjack recipe
does.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import ClassVar

import anyio
from anyio import WouldBlock

from plies import ConfigError, EnvError
from plies.environments import Env, Task
from plies.runtime import (
    EnvPool,
    EpisodeContext,
    GroupSpec,
    JsonlSink,
    RemoteRef,
    RolloutDriver,
    RolloutResources,
)
from plies.trajectory import Group, PolicyRef, Status, Trajectory

from .protocol import Harness

__all__ = ["DEFAULT_CLEANUP_TIMEOUT_S", "DEFAULT_GROUP_SIZE", "EnvGroup", "play_groups"]

log = logging.getLogger("plies.harness")

DEFAULT_GROUP_SIZE = 4
"""Members per group: the fewest with which a group-mean baseline says much."""
DEFAULT_CLEANUP_TIMEOUT_S = 30.0
"""How long `EnvGroup.cleanup` may take before the group is reported as not cleaned up."""

EnvFactory = Callable[[], Env | Awaitable[Env]]
"""Makes one member's env: an `Env` subclass itself, or a function, plain or async."""

_SCORED = (Status.COMPLETED, Status.TRUNCATED)
"""Members whose reward means something; the others keep None and their group is refused."""


class EnvGroup:
    """One group of episodes: its task, an env per member, its group rewards, its cleanup.

    Use it as it is with a factory of envs, or subclass it when the members share something
    (a dataset, one sandbox, a server session) or are scored against each other. Shared
    things belong here, not to an env and not to a module global: make them in `make_env`
    on first use and release them in `cleanup`, which runs once after every member has
    settled, on every path (done, error, cancellation), shielded and bounded by
    `cleanup_timeout_s`.

    Args:
        task: what every member plays.
        env: makes one member's env (an `Env` subclass, or a function, plain or async);
            not needed when a subclass overrides `make_env`.
        size: members in the group.

    Raises:
        ConfigError: `task` is not a `Task` or `size` is below 1.

    Example::

        group = EnvGroup(Task(id="guess-7", seed=7), GuessEnv, size=8)

        class Judged(EnvGroup):
            async def group_rewards(self, trajectories):
                best = max(len(t.turns) for t in trajectories)   # shorter is better
                return [0.1 * (best - len(t.turns)) for t in trajectories]
    """

    cleanup_timeout_s: ClassVar[float] = DEFAULT_CLEANUP_TIMEOUT_S

    def __init__(
        self, task: Task, env: EnvFactory | None = None, *, size: int = DEFAULT_GROUP_SIZE
    ):
        if not isinstance(task, Task):
            raise ConfigError(f"EnvGroup needs a plies.environments.Task, got {task!r}")
        if size < 1:
            raise ConfigError(f"group size must be at least 1, got {size}")
        self.task = task
        self.size = size
        self._env = env

    def __repr__(self) -> str:
        return f"<{type(self).__name__} task={self.task.id!r} size={self.size}>"

    async def make_env(self) -> Env:
        """A fresh env for one member. The default calls the `env` factory.

        Raises:
            ConfigError: there is no factory, or it made something that is not an `Env`.
        """
        if self._env is None:
            raise ConfigError(
                f"{type(self).__name__} needs an env factory (EnvGroup(task, MyEnv)) "
                "or a make_env override"
            )
        made = self._env()
        env = await made if inspect.isawaitable(made) else made
        if not isinstance(env, Env):
            raise ConfigError(f"the env factory of {self!r} made {env!r}, not an Env")
        return env

    async def group_rewards(self, trajectories: Sequence[Trajectory]) -> Sequence[float]:
        """Rewards that depend on the whole group, one per member, added to each one's own.

        Called once the group is complete, with the members in order. Values for members
        that failed (no reward of their own) are ignored. The default adds nothing.
        """
        return [0.0] * len(trajectories)

    async def cleanup(self) -> None:
        """Release what the members shared. The default has nothing to release."""

    def remote_refs(self) -> list[RemoteRef]:
        """Remote state the group shares; named in the error when `cleanup` fails."""
        return []


async def play_groups(
    harness: Harness,
    groups: Iterable[EnvGroup],
    *,
    policy: PolicyRef,
    sink: JsonlSink | None = None,
    report_path: Path | str | None = None,
    max_groups_in_flight: int | None = None,
) -> list[Group]:
    """Play every member of every group under `policy`; return the groups, scored, in order.

    Each group gets its own env pool (one env per member, made by `EnvGroup.make_env`, torn
    down or quarantined when the member settles), all inside one `RolloutResources` scope.
    As each group completes, its group rewards are added to its members' rewards (the
    harness's `RewardPolicy` has already scored each member), its `cleanup` runs, and it is
    written to `sink`.

    Args:
        harness: plays each member (any `Harness`: the built-in loop, or an agent program
            behind a gateway); its policy client samples every turn.
        groups: the groups to play.
        policy: the policy every turn is sampled from (a published `PolicyRef`).
        sink: where each scored group is written (fsynced) once complete.
        report_path: where the quarantine report goes, if any env could not be torn down.
        max_groups_in_flight: most groups played at once (None: all of them).

    Returns:
        The complete groups in the order given; each member carries its total reward and, in
        `info["group_reward"]`, the part the group added.

    Raises:
        ConfigError: two groups share one object, or `group_rewards` returned the wrong
            number of values or a value that is not finite.
        EnvError: a group's `cleanup` failed or ran past `cleanup_timeout_s`; what it may
            still hold is named. Groups not yet cleaned up are cleaned up first.
        PolicyError, LeaseError: the remote parts failed (members failed by env errors are
            returned as `failed`, not raised).

    Example::

        groups = await play_groups(harness, [EnvGroup(task, GuessEnv, size=8)], policy=ref)
        selection = training_groups(groups, policy=ref, max_staleness=0)
    """
    owners = list(groups)
    if len({id(g) for g in owners}) != len(owners):
        raise ConfigError("play_groups was given the same EnvGroup twice; make one per group")
    specs = [GroupSpec(task_id=g.task.id, size=g.size, task=g.task) for g in owners]
    pools = {
        spec.id: EnvPool(owner.make_env, name=f"group-{k}:{owner.task.id}", limit=owner.size)
        for k, (spec, owner) in enumerate(zip(specs, owners, strict=True))
    }
    by_id = {spec.id: owner for spec, owner in zip(specs, owners, strict=True)}
    pending = dict(by_id)  # not yet cleaned up
    done: dict[str, Group] = {}

    async def episode(ctx: EpisodeContext) -> Trajectory:
        return await harness.play(ctx, pool=pools[ctx.group_id])

    try:
        async with (
            RolloutResources(
                sampler=harness.sampler, pools=pools.values(), report_path=report_path
            ) as resources,
            RolloutDriver(
                resources, episode, policy=policy, max_groups_in_flight=max_groups_in_flight
            ) as driver,
        ):
            admit = _Admission(driver, specs)
            admit.more()
            async for group in driver.groups():
                admit.more()  # a group was handed out: room for the next
                owner = pending.pop(group.id)
                try:
                    group = await _scored(owner, group)
                finally:
                    await _cleanup(owner)
                if sink is not None:
                    sink.write_group(group)
                done[group.id] = group
    finally:
        # Only an error or a cancellation leaves groups here; it propagates, so what their
        # cleanup could not release is logged rather than raised over it.
        for owner in pending.values():
            try:
                await _cleanup(owner)
            except EnvError as err:
                log.error("%s", err)
    return [done[spec.id] for spec in specs]


class _Admission:
    """Admits the specs in order, as many as the driver's bound lets in, without a task."""

    def __init__(self, driver: RolloutDriver, specs: Sequence[GroupSpec]):
        self.driver = driver
        self.specs = specs
        self.next = 0

    def more(self) -> None:
        while self.next < len(self.specs):
            try:
                self.driver.admit_nowait(self.specs[self.next])
            except WouldBlock:
                return
            self.next += 1
        self.driver.close_admission()


async def _scored(owner: EnvGroup, group: Group) -> Group:
    """`group` with `owner`'s group rewards added to its scored members' rewards."""
    members = group.trajectories
    extra = list(await owner.group_rewards(members))
    if len(extra) != len(members):
        raise ConfigError(
            f"{type(owner).__name__}.group_rewards returned {len(extra)} values for "
            f"{len(members)} members"
        )
    bad = [
        x
        for x in extra
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x)
    ]
    if bad:
        raise ConfigError(
            f"{type(owner).__name__}.group_rewards returned {bad[0]!r}; rewards must be finite"
        )
    scored = [
        t.model_copy(
            update={"reward": t.reward + bonus, "info": {**t.info, "group_reward": float(bonus)}}
        )
        if t.status in _SCORED and t.reward is not None
        else t
        for t, bonus in zip(members, extra, strict=True)
    ]
    return group.model_copy(update={"trajectories": scored})


async def _cleanup(owner: EnvGroup) -> None:
    """Run `owner.cleanup()` shielded and bounded; a failure becomes an `EnvError`."""
    with anyio.CancelScope(shield=True):
        try:
            with anyio.fail_after(owner.cleanup_timeout_s):
                await owner.cleanup()
        except Exception as err:
            refs = [ref.model_dump() for ref in owner.remote_refs()]
            held = f"; it may still hold {refs}" if refs else ""
            raise EnvError(
                f"cleanup of {owner!r} failed ({type(err).__name__}: {err}){held}"
            ) from err
