"""`ShardedDriver`: rollout shards as Ray actors behind one driver-like object in the head.

Why: one process drives many concurrent episodes until its per-turn CPU is the bound. Past
that, more processes (on one machine, or on a Ray cluster) each run a `RolloutDriver` of their
own, and the head, the process that trains, sees one driver: `admit` / `statistics` / `collect` /
`groups` / `stop`, one merged stream of complete groups, one quarantine report.

How it is split:

- each shard is a Ray actor that calls the user's factory (`make_shard(index)`, pickled to
  it) to build its policy client, pools and episode, then runs them in a `RolloutResources`
  scope and a `RolloutDriver` of its own. Nothing but the factory, group specs, policies and
  finished records crosses between processes;
- the head admits a group locally (bound to its current policy, against its own
  `max_groups_in_flight`), places it on the shard with the fewest groups in flight and sends
  admissions in batches. Complete groups come back in batches as JSON and are written to
  the head's sink (fsynced) before they are handed out, so a group handed to training is on
  disk, as with one process;
- each shard's quarantine records come back with its batches; the head writes their union
  as one report;
- `close_admission`, `cancel`, `abort` and `set_policy` fan out to every shard, so `run`'s
  three-step Ctrl-C applies to all of them at once;
- a shard that dies (its process killed, its node lost) does not lose its episodes
  silently: every group it held that had not come back is settled in the head, each member
  `failed` with a `ShardLost` error, written to the sink and handed out like any other
  group, and logged. The other shards go on.

The shard's side (its factory's `ShardSetup`, the actor) is in `_shard.py`. Ray is imported
only when a `ShardedDriver` opens, so the base install does not need it.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
from anyio import CancelScope
from anyio.abc import TaskGroup

from .._exceptions import ConfigError, PliesError, UsageError
from ..trajectory import Group, PolicyRef, Status, Trajectory
from ._admission import (
    DEFAULT_MAX_GROUPS_IN_FLIGHT,
    DriverBase,
    DriverState,
    EpisodeCounts,
    Stop,
)
from ._episode import GroupSpec
from ._handout import Handout
from ._report import QuarantineRecord
from ._resources import ResourcesStatistics, _write_records
from ._shard import Batch, Counts, Final, ShardActor, ShardFactory
from ._sink import JsonlSink
from ._writer import DurableWriter

__all__ = ["ShardLost", "ShardStatistics", "ShardedDriver"]

log = logging.getLogger("plies.runtime")

DEFAULT_SHARD_EXIT_TIMEOUT = 60.0
"""Seconds the head waits at exit for shards to finish and report, past their own grace."""
PULL_LINGER = 0.02
"""After a shard's first complete group, seconds it waits for more before replying."""
PULL_TIMEOUT = 0.25
"""A shard replies at least this often, with its counts, even with no group complete."""


class ShardLost(PliesError):
    """A shard's actor died; the episodes it held were settled as failed with this error."""


@dataclass(frozen=True, slots=True)
class ShardStatistics:
    """One shard as the head sees it."""

    index: int
    pid: int
    """The actor's process id (on its node)."""
    cpu_s: float
    """CPU time its process has used (all threads), as of its last reply."""
    alive: bool
    """False once its actor died (or did not finish in time at exit)."""
    groups_in_flight: int
    """Groups placed on it that have not come back."""
    groups_lost: int
    """Groups it held when it died, settled in the head as failed."""
    running: int
    turns: int
    policy: PolicyRef
    """The policy its own driver admits under (what `set_policy` fanned out)."""
    leases: ResourcesStatistics


class _Shard:
    """The head's side of one shard: its actor, what it holds, its last counts."""

    def __init__(self, index: int, actor: Any, policy: PolicyRef):
        self.index = index
        self.actor = actor
        self.outbox: list[tuple[GroupSpec, PolicyRef]] = []
        self.outbox_event = anyio.Event()
        self.sent: deque[Any] = deque()
        """Admission calls handed to Ray whose replies (the ids refused) are not read yet."""
        self.admit_calls = 0
        """Admission calls handed to Ray so far; a drain is ordered after them."""
        self.held: dict[str, tuple[GroupSpec, PolicyRef]] = {}
        """Groups placed here and not back yet, by id (those in `outbox` included)."""
        self.counts = Counts(0, 0.0, 0, {}, 0, policy, ResourcesStatistics(0, 0, 0, 0, 0, ()))
        self.received: dict[Status, int] = dict.fromkeys(Status, 0)
        self.records: list[QuarantineRecord] = []
        self.alive = True
        self.lost = 0
        self.final = False
        self.pulled_all = False

    @property
    def finished(self) -> bool:
        """Nothing more will come from it: it closed and was pulled dry, or it was lost."""
        return not self.alive or (self.final and self.pulled_all)

    @property
    def settled(self) -> dict[Status, int]:
        """Settled episodes by status: its own counts while alive, what came back once dead."""
        if self.alive:
            return {s: max(self.counts.settled.get(s, 0), self.received[s]) for s in Status}
        return self.received

    def send_outbox(self) -> None:
        """Hand the queued admissions to Ray (ordered after what was handed before)."""
        if self.outbox and self.alive:
            items, self.outbox = self.outbox, []
            self.sent.append(self.actor.admit.remote(items))
            self.admit_calls += 1


def _import_ray() -> Any:
    missing = "ShardedDriver needs Ray: pip install 'plies[ray]' (or use RolloutDriver)"
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(missing) from exc
    if not hasattr(ray, "remote"):  # a folder named ray on sys.path, not the package
        raise ConfigError(f"{missing}; `import ray` found {list(ray.__path__)}")
    return ray


class ShardedDriver(DriverBase):
    """Runs episodes on `shards` Ray actors and yields their complete groups in the head.

    It is a `RolloutDriver` to its caller: the same `DriverBase` (`admit`, `admit_nowait`,
    `statistics`, `collect`, `groups`, `stop`, `close_admission`, `cancel`, `abort`,
    `set_policy`), written once; this class holds only the shards' transport and lifecycle. And
    `Interrupts.attach` takes it, so `plies.runtime.run` gives it the same three Ctrl-C
    steps, applied to every shard.

    Args:
        make_shard: `make_shard(index) -> ShardSetup` (or an async context manager yielding
            one), called in each shard's actor; it must pickle (a module-level function).
        shards: how many actors.
        policy: the policy current now; `set_policy` moves it forward on every shard.
        max_groups_in_flight: most groups admitted and not yet handed out, over all shards.
        sink: where each complete group is written (fsynced) before it is handed out.
        report_path: where the merged quarantine report goes (every shard's records).
        run_id: names the run in the report; shards are `RUN_ID-shardN`.
        address: the Ray cluster to join when Ray is not initialized yet ("auto", or
            "ray://host:10001"); None starts a local Ray. A Ray the driver started is shut
            down when it closes; one that was running already is left running.
        actor_options: passed to `.options()` of each actor (default `num_cpus=1`), e.g.
            `{"num_cpus": 4}` or a `scheduling_strategy` to spread shards over nodes.
        shard_options: one mapping per shard, laid over `actor_options` for that shard's
            actor alone (key by key: a shard's `resources` replaces the common ones). It pins
            a shard to a node when the shard needs what only that node has (its envs, its
            engine, its disk): start each node with a resource of its own (`ray start
            --resources '{"node_a": 1}'`) and pass `[{"resources": {"node_a": 1}}, ...]`.
        exit_timeout: seconds the head waits at exit for shards to finish before it counts
            them lost.

    Example::

        def make_shard(index: int) -> ShardSetup:
            client = ...                                   # built in the shard's process
            harness = ToolCallingHarness(ChatRenderer(tok), client, params)
            return ShardSetup(harness.play, pools=[EnvPool(make_env)], sampler=client)

        async with ShardedDriver(make_shard, shards=4, policy=ref, sink=sink) as driver:
            ...                                            # as with a RolloutDriver
    """

    def __init__(
        self,
        make_shard: ShardFactory,
        *,
        shards: int = 2,
        policy: PolicyRef,
        max_groups_in_flight: int = DEFAULT_MAX_GROUPS_IN_FLIGHT,
        sink: JsonlSink | None = None,
        report_path: Path | str | None = None,
        run_id: str | None = None,
        address: str | None = None,
        actor_options: dict[str, Any] | None = None,
        shard_options: Sequence[Mapping[str, Any]] | None = None,
        exit_timeout: float = DEFAULT_SHARD_EXIT_TIMEOUT,
    ):
        if shards < 1:
            raise ConfigError(f"shards must be at least 1, got {shards}")
        if shard_options is not None and len(shard_options) != shards:
            raise ConfigError(f"shard_options has {len(shard_options)} entries for {shards} shards")
        self._writer = DurableWriter(self._report_write if report_path is not None else None)
        super().__init__(
            policy=policy,
            max_groups_in_flight=max_groups_in_flight,
            handout=Handout(self._writer),
        )
        self.shards = shards
        self.sink = sink
        self.report_path = Path(report_path) if report_path is not None else None
        self.run_id = run_id or uuid.uuid4().hex
        self.address = address
        self.actor_options = {"num_cpus": 1, **(actor_options or {})}
        self.shard_options = [dict(o) for o in shard_options or [{}] * shards]
        self.exit_timeout = exit_timeout
        self._make_shard = make_shard
        self._ray: Any = None
        self._owns_ray = False
        self._shards: list[_Shard] = []
        self._writer_tg: TaskGroup | None = None
        self._tg: TaskGroup | None = None

    def __repr__(self) -> str:
        alive = sum(s.alive for s in self._shards)
        return f"<ShardedDriver {self.state} shards={alive}/{self.shards}>"

    # lifetime -------------------------------------------------------------------------------

    async def __aenter__(self) -> ShardedDriver:
        if self.state is not DriverState.UNOPENED:
            raise UsageError(f"driver is {self.state}; a driver opens once")
        if self.report_path is not None and not self.report_path.parent.is_dir():
            raise ConfigError(f"report directory {self.report_path.parent} does not exist")
        ray = self._ray = _import_ray()
        if not ray.is_initialized():
            # A local Ray (no address) is started without its dashboard: nothing here reads it.
            local = {"include_dashboard": False} if self.address is None else {}
            ray.init(address=self.address, **local)
            self._owns_ray = True
        self.state = DriverState.ADMITTING
        try:
            self._writer_tg = anyio.create_task_group()
            await self._writer_tg.__aenter__()
            await self._writer_tg.start(self._writer.run)
            actor_class = ray.remote(ShardActor)
            for index, own in enumerate(self.shard_options):
                options = {**self.actor_options, **own, "max_restarts": 0}
                actor = actor_class.options(**options).remote(
                    index, self._make_shard, self._policy, self.run_id
                )
                self._shards.append(_Shard(index, actor, self._policy))
            runs = [shard.actor.run.remote() for shard in self._shards]
            await _gather([shard.actor.wait_ready.remote() for shard in self._shards])
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
            # Shielded: a cancelled body (the third Ctrl-C) must not stop the head from
            # collecting what every shard settled and reported; exit bounds the wait.
            self._tg.cancel_scope.shield = True
            for shard, run in zip(self._shards, runs, strict=True):
                self._tg.start_soon(self._watch, shard, run, name=f"shard {shard.index}")
                self._tg.start_soon(self._pull_loop, shard, name=f"shard {shard.index} pull")
                self._tg.start_soon(self._admit_loop, shard, name=f"shard {shard.index} admit")
        except BaseException:
            if self._tg is not None:
                tg, self._tg = self._tg, None
                tg.cancel_scope.cancel()
                await tg.__aexit__(None, None, None)
            await self._teardown()
            raise
        return self

    async def _close(self) -> None:
        """Wait (up to `exit_timeout`) for every shard to finish and hand back its groups and
        records, write them, then kill the actors."""
        try:
            with CancelScope(shield=True):
                with anyio.move_on_after(self.exit_timeout):
                    while not all(s.finished for s in self._shards):
                        await self._handout.wait()
                for shard in self._shards:
                    if not shard.finished:
                        self._lose(shard, f"did not finish within {self.exit_timeout:g} s")
            if self._tg is not None:
                tg, self._tg = self._tg, None
                tg.cancel_scope.cancel()
                await tg.__aexit__(None, None, None)
            with CancelScope(shield=True):
                while self._handout.writing:
                    await self._handout.wait()
                self._say_what_is_left()
        finally:
            await self._teardown()

    async def _teardown(self) -> None:
        """Final report, writer stopped, actors killed, an owned Ray shut down."""
        try:
            if self._writer_tg is not None:
                with CancelScope(shield=True):
                    await self._writer.wait_idle()
                    await anyio.to_thread.run_sync(self._report_write(final=True))
        finally:
            try:
                if self._writer_tg is not None:
                    tg, self._writer_tg = self._writer_tg, None
                    self._writer.stop()
                    tg.cancel_scope.cancel()
                    await tg.__aexit__(None, None, None)
            finally:
                for shard in self._shards:
                    with contextlib.suppress(Exception):
                        self._ray.kill(shard.actor, no_restart=True)
                if self._owns_ray:
                    self._owns_ray = False
                    self._ray.shutdown()
                self.state = DriverState.CLOSED
                self._handout.wake()

    # shards -----------------------------------------------------------------------------------

    async def _watch(self, shard: _Shard, run: Any) -> None:
        """Wait for the shard's `run`: its final counts and records, or its death."""
        try:
            final: Final = await run
        except Exception as exc:  # RayActorError, or the shard's own error
            self._lose(shard, f"{type(exc).__name__}: {exc}")
            return
        shard.counts = final.counts
        shard.records = [_tag_record(shard.index, r) for r in final.records]
        shard.final = True
        self._writer.report_changed()
        self._handout.wake()

    async def _pull_loop(self, shard: _Shard) -> None:
        while shard.alive:
            try:
                batch: Batch = await shard.actor.pull.remote(PULL_LINGER, PULL_TIMEOUT)
            except Exception as exc:
                self._lose(shard, f"{type(exc).__name__}: {exc}")
                return
            self._absorb(shard, batch)
            if batch.done:
                shard.pulled_all = True
                self._handout.wake()
                return

    async def _admit_loop(self, shard: _Shard) -> None:
        """Send each shard's queued admissions as one call; one call in flight at a time."""
        while shard.alive:
            if shard.sent:
                try:
                    refused = await shard.sent.popleft()
                except Exception as exc:
                    self._lose(shard, f"{type(exc).__name__}: {exc}")
                    return
                self._refused(shard, refused)
            elif shard.outbox:
                shard.send_outbox()
            elif self.state is DriverState.ADMITTING:
                event = shard.outbox_event
                await event.wait()
            else:
                return

    def _absorb(self, shard: _Shard, batch: Batch) -> None:
        shard.counts = batch.counts
        if batch.records is not None:
            shard.records = [_tag_record(shard.index, r) for r in batch.records]
            self._writer.report_changed()  # rewritten before the groups below are handed out
        for text in batch.groups:
            group = _tag_group(shard.index, Group.model_validate_json(text))
            held = shard.held.pop(group.id, None)
            if held is None:
                continue  # already settled here (the shard was counted lost meanwhile)
            for traj in group.trajectories:
                shard.received[traj.status or Status.FAILED] += 1
            self._handout.add(group, self.sink)
        self._handout.wake()

    def _refused(self, shard: _Shard, ids: list[str]) -> None:
        """Groups the shard would not take (its admission had closed): settled cancelled."""
        for group_id in ids:
            item = shard.held.pop(group_id, None)
            if item is not None:
                self._finish_here(shard, *item, Status.CANCELLED, None)

    def _lose(self, shard: _Shard, why: str) -> None:
        """The shard is gone: settle every group it held as failed, and say so."""
        if not shard.alive:
            return
        shard.alive = False
        held = list(shard.held.values())  # the outbox's groups are held too
        shard.held.clear()
        shard.outbox = []
        shard.lost = len(held)
        episodes = sum(spec.size for spec, _ in held)
        error = ShardLost(f"shard {shard.index} died: {why}")
        log.error(
            "plies: shard %d lost (%s); its %d groups in flight (%d episodes) are settled "
            "as failed",
            shard.index,
            why,
            len(held),
            episodes,
        )
        for spec, policy in held:
            self._finish_here(shard, spec, policy, Status.FAILED, error)
        self._writer.report_changed()
        self._handout.wake()

    def _finish_here(
        self,
        shard: _Shard,
        spec: GroupSpec,
        policy: PolicyRef,
        status: Status,
        error: Exception | None,
    ) -> None:
        members = []
        for _ in range(spec.size):
            traj = Trajectory(task_id=spec.task_id, group_id=spec.id)
            if error is not None:
                kind = type(error)
                traj.settle(status, error=f"{kind.__module__}.{kind.__qualname__}: {error}")
            else:
                traj.settle(status)
            members.append(traj)
            shard.received[status] += 1
        group = Group(
            id=spec.id, task_id=spec.task_id, size=spec.size, policy=policy, trajectories=members
        )
        self._handout.add(group, self.sink)

    def _say_what_is_left(self) -> None:
        """One line per shard when the run was cancelled, or a shard left something behind:
        its quarantined leases (and how many may still exist), its groups lost."""
        cancelled = self._stop is not None and self._stop >= Stop.CANCEL
        for shard in self._shards:
            may_exist = sum(r.may_exist for r in shard.records)
            if not cancelled and shard.alive and not may_exist and not shard.counts.running:
                continue
            log.warning(
                "plies: shard %d: %s, %d running, %d quarantined (%d may still exist), "
                "%d groups lost",
                shard.index,
                "alive" if shard.alive else "lost",
                shard.counts.running if shard.alive else 0,
                len(shard.records),
                may_exist,
                shard.lost,
            )

    def _report_write(self, *, final: bool = False) -> Callable[[], None]:
        records = [r for shard in self._shards for r in shard.records]
        return partial(_write_records, self.report_path, self.run_id, records, final)

    # the driver's hooks -----------------------------------------------------------------------

    def _policy_moved(self, policy: PolicyRef) -> None:
        for shard in self._shards:
            if shard.alive:
                shard.actor.set_policy.remote(policy)

    def _refusal(self) -> str | None:
        if not any(s.alive for s in self._shards):
            return "every shard died; see the log for why"
        return None

    def _place(self, spec: GroupSpec, policy: PolicyRef) -> None:
        """Queue the group for the shard with the fewest groups in flight."""
        shard = min((s for s in self._shards if s.alive), key=lambda s: len(s.held))
        shard.held[spec.id] = (spec, policy)
        shard.outbox.append((spec, policy))
        shard.outbox_event.set()
        shard.outbox_event = anyio.Event()
        self._admitted += spec.size

    def _stopped(self, step: Stop) -> None:
        """Bring every shard to `step`.

        Groups admitted but not yet sent to their shard are sent first. Each shard drains only
        after the admission calls sent before the drain; a cancel or abort acts at once, so a
        shard may refuse groups that reach it later, and those are settled here as
        `cancelled`.
        """
        for shard in self._shards:
            if shard.alive:
                shard.send_outbox()
                shard.actor.step.remote(int(step), shard.admit_calls)
            shard.outbox_event.set()  # an idle admit loop sees admission closed and ends

    def _busy(self) -> bool:
        return any(s.held for s in self._shards)

    def _episode_counts(self) -> EpisodeCounts:
        """Over every shard, each as of its last reply."""
        settled = dict.fromkeys(Status, 0)
        for shard in self._shards:
            for status, n in shard.settled.items():
                settled[status] += n
        leases = [s.counts.leases for s in self._shards]
        merged = ResourcesStatistics(
            borrowed=sum(s.borrowed for s in leases),
            live=sum(s.live for s in leases),
            released=sum(s.released for s in leases),
            quarantined=sum(s.quarantined for s in leases),
            may_exist=sum(s.may_exist for s in leases),
            pools=tuple(p for s in leases for p in s.pools),
        )
        return EpisodeCounts(
            running=max(self._admitted - sum(settled.values()), 0),
            settled=settled,
            turns=sum(s.counts.turns for s in self._shards),
            leases=merged,
        )

    def shard_statistics(self) -> list[ShardStatistics]:
        """Each shard's own view: alive, groups held and lost, its policy and leases."""
        return [
            ShardStatistics(
                index=s.index,
                pid=s.counts.pid,
                cpu_s=s.counts.cpu_s,
                alive=s.alive,
                groups_in_flight=len(s.held),
                groups_lost=s.lost,
                running=s.counts.running if s.alive else 0,
                turns=s.counts.turns,
                policy=s.counts.policy,
                leases=s.counts.leases,
            )
            for s in self._shards
        ]


def _lease_tag(index: int, lease_id: str) -> str:
    """A lease id unique over shards: each shard's pools number their leases alike."""
    return f"shard{index}/{lease_id}"


def _tag_record(index: int, record: QuarantineRecord) -> QuarantineRecord:
    return record.model_copy(update={"lease_id": _lease_tag(index, record.lease_id)})


def _tag_group(index: int, group: Group) -> Group:
    """The group with its quarantined leases named as the merged report names them."""
    if not any("quarantined_leases" in t.info for t in group.trajectories):
        return group
    members = []
    for traj in group.trajectories:
        leases = traj.info.get("quarantined_leases")
        if leases:
            tagged = [{**q, "lease": _lease_tag(index, q["lease"])} for q in leases]
            traj = traj.model_copy(update={"info": {**traj.info, "quarantined_leases": tagged}})
        members.append(traj)
    return group.model_copy(update={"trajectories": members})


async def _gather(refs: list[Any]) -> list[Any]:
    """Await Ray object refs in order (each raises its own error)."""
    return [await ref for ref in refs]
