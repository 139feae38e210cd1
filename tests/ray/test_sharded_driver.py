"""`ShardedDriver` on a local Ray: the same groups as one process, policy fan-out, a lost shard.

Every shard is a real Ray actor whose episodes sample from and step on a real loopback
server (`shard_parts.py`); the in-process `RolloutDriver` runs the same episodes.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from shard_parts import SKIP, Episode, StandInPolicy, episode, make_pool, make_shard, task

pytest.importorskip("ray.actor", reason=SKIP)

from plies import ConfigError, Group, PolicyRef, Status
from plies.rl import played, repeat_certain
from plies.runtime import (
    GroupSpec,
    JsonlSink,
    RolloutDriver,
    RolloutResources,
    ShardedDriver,
    read_jsonl,
)
from plies.runtime._report import read_report
from plies.runtime._shard import ShardActor

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

V0 = PolicyRef(uri="plies://ray/policies/0", version=0)
V1 = PolicyRef(uri="plies://ray/policies/1", version=1)
SPECS = [GroupSpec(f"task{i}", size=2, task=task(1 + i % 3), id=f"g{i}") for i in range(12)]


def shard_processes() -> list[str]:
    """Live shard actors of this session's Ray (Ray titles an actor's process after it)."""
    out = subprocess.run(
        ["ps", "-eo", "pid=,sid=,stat=,args="], capture_output=True, text=True, check=True
    ).stdout
    sid = os.getsid(0)
    return [
        line.strip()
        for line in out.splitlines()
        if (parts := line.split(None, 3))[1] == str(sid)
        and not parts[2].startswith("Z")
        and parts[3:]
        and parts[3].startswith("ray::ShardActor")
    ]


@pytest.fixture(autouse=True)
def no_shard_left(local_ray) -> Iterator[None]:
    """After each test every shard actor it started is gone, whatever the test did."""
    yield
    deadline = time.monotonic() + 15
    while shard_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert shard_processes() == []


def shape(groups: list[Group]) -> list[tuple[Any, ...]]:
    """What must agree between runs: ids, policies, and each member's status and turns."""
    return sorted(
        (
            g.id,
            g.task_id,
            g.size,
            g.policy.uri,
            sorted(
                (
                    t.status,
                    t.group_id,
                    [(u.prompt_ids, u.completion_ids, u.policy.uri) for u in t.turns],
                )
                for t in g.trajectories
            ),
        )
        for g in groups
    )


async def admit_all(driver: Any, specs: list[GroupSpec]) -> None:
    for spec in specs:
        await driver.admit(spec)
    driver.close_admission()


async def run_in_process(
    url: str, tmp: Path, specs: list[GroupSpec] = SPECS, play: Episode = episode
) -> list[Group]:
    async with httpx.AsyncClient(timeout=60) as http:
        policy = StandInPolicy(url, http)
        with JsonlSink(tmp / "one.jsonl") as sink:
            async with (
                RolloutResources(sampler=policy, pools=[make_pool()]) as res,
                RolloutDriver(res, play, policy=V0, max_groups_in_flight=4, sink=sink) as d,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(admit_all, d, specs)
                return [g async for g in d.groups()]


async def test_same_groups_as_one_process(local_ray, policy_url, tmp_path):
    one = await run_in_process(policy_url, tmp_path)
    with JsonlSink(tmp_path / "sharded.jsonl") as sink:
        async with ShardedDriver(
            partial(make_shard, policy_url),
            shards=2,
            policy=V0,
            max_groups_in_flight=4,
            sink=sink,
            report_path=tmp_path / "quarantine.json",
        ) as d:
            async with anyio.create_task_group() as tg:
                tg.start_soon(admit_all, d, SPECS)
                sharded = [g async for g in d.groups()]
            assert d.collect() == []
            stats, shards = d.statistics(), d.shard_statistics()
            assert len(shard_processes()) == 2  # what `no_shard_left` looks for is there
    assert shape(sharded) == shape(one)
    assert len(shape(one)) == len(SPECS)
    on_disk = read_jsonl(tmp_path / "sharded.jsonl", Group)
    assert on_disk.malformed == [] and shape(on_disk.records) == shape(one)
    assert stats.settled[Status.COMPLETED] == stats.admitted == 2 * len(SPECS)
    assert stats.turns == sum(len(t.turns) for g in one for t in g.trajectories)
    assert stats.leases.balanced and stats.leases.released == stats.admitted
    assert stats.groups_in_flight == 0 and stats.running == 0
    # Both shards took work; the merged report is written, complete and empty.
    assert all(s.alive and s.turns > 0 for s in shards), shards
    assert sum(s.turns for s in shards) == stats.turns
    report = read_report(tmp_path / "quarantine.json")
    assert report.complete and report.entries == []


async def test_a_certain_group_repeats_its_first_member_on_a_shard_as_in_one_process(
    local_ray, policy_url, tmp_path
):
    """`repeat_certain` is an episode wrapper, so a shard runs it as one process does: a group
    whose first member drew every token with certainty holds that member and three repeats."""
    specs = [
        GroupSpec(f"task{i}", size=4, task=task(2, sure=i % 2 == 0), id=f"d{i}") for i in range(6)
    ]
    play = repeat_certain(episode)
    one = await run_in_process(policy_url, tmp_path, specs, play)
    async with ShardedDriver(
        partial(make_shard, policy_url, play=play), shards=2, policy=V0, max_groups_in_flight=4
    ) as d:
        async with anyio.create_task_group() as tg:
            tg.start_soon(admit_all, d, specs)
            sharded = [g async for g in d.groups()]
        stats = d.statistics()
    assert shape(sharded) == shape(one)
    assert sorted((g.id, g.size, played(g)) for g in sharded) == [
        (f"d{i}", 4, 1 if i % 2 == 0 else 4) for i in range(6)
    ]
    assert stats.admitted == stats.settled[Status.COMPLETED] == 6 * 4
    assert stats.running == 0 and stats.groups_in_flight == 0


async def test_set_policy_fans_out_to_every_shard(local_ray, policy_url, tmp_path):
    async with ShardedDriver(
        partial(make_shard, policy_url), shards=2, policy=V0, max_groups_in_flight=8
    ) as d:
        first = [GroupSpec(f"a{i}", size=2, task=task(2)) for i in range(4)]
        for spec in first:
            assert (await d.admit(spec)).policy == V0
        got = [g async for g in take(d, len(first))]
        d.set_policy(V1)
        with pytest.raises(ConfigError, match="went back"):
            d.set_policy(V0)
        # Every shard admits under V1 before it is given a single group under it.
        with anyio.fail_after(10):
            while any(s.policy != V1 for s in d.shard_statistics()):
                await anyio.sleep(0.05)
        second = [GroupSpec(f"b{i}", size=2, task=task(2)) for i in range(4)]
        for spec in second:
            assert (await d.admit(spec)).policy == V1
        d.close_admission()
        got += [g async for g in d.groups()]
    by_id = {g.task_id: g for g in got}
    assert sorted(by_id) == sorted(s.task_id for s in first + second)
    for spec in first + second:
        group = by_id[spec.task_id]
        want = V0 if spec in first else V1
        assert group.policy == want
        assert {u.policy for t in group.trajectories for u in t.turns} == {want}
        assert all(t.status is Status.COMPLETED for t in group.trajectories)


async def take(driver: ShardedDriver, n: int):
    async for group in driver.groups():
        yield group
        n -= 1
        if not n:
            return


async def test_killed_shard_in_flight_episodes_are_reported(
    local_ray, policy_url, tmp_path, caplog
):
    caplog.set_level(logging.ERROR, logger="plies.runtime")
    specs = [GroupSpec(f"slow{i}", size=2, task=task(2, sample_s=1.0)) for i in range(4)]
    with JsonlSink(tmp_path / "groups.jsonl") as sink:
        async with ShardedDriver(
            partial(make_shard, policy_url), shards=2, policy=V0, max_groups_in_flight=8, sink=sink
        ) as d:
            for spec in specs:
                await d.admit(spec)
            with anyio.fail_after(10):  # both shards run their two groups
                while min(s.running for s in d.shard_statistics()) < 4:
                    await anyio.sleep(0.05)
            victim = d.shard_statistics()[0]
            os.kill(victim.pid, signal.SIGKILL)
            started = time.monotonic()
            lost = [g async for g in take(d, 2)]
            # The dead shard's groups come back first, settled as failed, long before the
            # survivor's episodes (two turns of a 1 s sample) could end.
            assert time.monotonic() - started < 1.5
            late = GroupSpec("late", size=1, task=task(1))
            await d.admit(late)  # placed on the shard still alive
            d.close_admission()
            rest = [g async for g in d.groups()]
            stats, shards = d.statistics(), d.shard_statistics()
    assert not shards[0].alive and shards[0].groups_lost == 2 and shards[0].groups_in_flight == 0
    assert shards[1].alive
    for group in lost:
        assert [t.status for t in group.trajectories] == [Status.FAILED] * 2
        assert all("ShardLost" in t.error and "shard 0 died" in t.error for t in group.trajectories)
    assert all(t.status is Status.COMPLETED for g in rest for t in g.trajectories)
    ids = sorted(g.task_id for g in lost + rest)
    assert ids == sorted([s.task_id for s in specs] + ["late"])
    on_disk = read_jsonl(tmp_path / "groups.jsonl", Group)
    assert on_disk.malformed == [] and sorted(g.task_id for g in on_disk.records) == ids
    assert stats.settled[Status.FAILED] == 4 and stats.settled[Status.COMPLETED] == 5
    assert stats.running == 0
    assert any("shard 0 lost" in r.getMessage() for r in caplog.records)


async def test_a_shard_lost_with_groups_not_yet_sent_settles_each_once(
    local_ray, policy_url, tmp_path
):
    # Groups the head placed on a shard wait in its outbox until the admit loop sends them;
    # a shard lost then must settle each of them once (they are held there as well).
    specs = [GroupSpec(f"queued{i}", size=2, task=task(1)) for i in range(2)]
    with JsonlSink(tmp_path / "groups.jsonl") as sink:
        async with ShardedDriver(
            partial(make_shard, policy_url), shards=1, policy=V0, sink=sink
        ) as d:
            for spec in specs:
                d.admit_nowait(spec)  # no checkpoint: both still in the outbox
            d._lose(d._shards[0], "lost before its admissions were sent")
            d.close_admission()
            groups = [g async for g in d.groups()]
            stats, shards = d.statistics(), d.shard_statistics()
    assert sorted(g.task_id for g in groups) == ["queued0", "queued1"]
    assert shards[0].groups_lost == 2 and shards[0].groups_in_flight == 0
    assert stats.settled[Status.FAILED] == 4 and stats.groups_in_flight == 0
    assert len(read_jsonl(tmp_path / "groups.jsonl", Group).records) == 2


@asynccontextmanager
async def broken_shard(index: int):
    yield "not a setup"


async def test_a_shard_that_cannot_start_fails_the_open(local_ray):
    driver = ShardedDriver(broken_shard, shards=2, policy=V0)
    with pytest.raises(ConfigError, match="returned str, not a ShardSetup"):
        async with driver:
            pass
    assert driver.state.value == "closed"


async def test_a_drain_that_overtakes_an_admission_waits_for_it(policy_url):
    """Ray may start an async actor's `step` before an `admit` sent earlier; the drain waits.

    The actor's class runs here in-process (no Ray), with calls in the order Ray may run them.
    """
    actor = ShardActor(0, partial(make_shard, policy_url), V0, "order")
    spec = GroupSpec("late", size=2, task=task(1), id="late")
    async with anyio.create_task_group() as tg:
        tg.start_soon(actor.run)
        await actor.wait_ready()
        tg.start_soon(actor.step, 1, 1)  # the drain, told of one admission sent before it
        await anyio.sleep(0.2)  # it has run up to its wait
        assert await actor.admit([(spec, V0)]) == []
        groups, done = [], False
        with anyio.fail_after(10):
            while not done:
                batch = await actor.pull(0.0, 0.25)
                groups += [Group.model_validate_json(text) for text in batch.groups]
                done = batch.done
    assert [g.id for g in groups] == ["late"]
    assert [t.status for t in groups[0].trajectories] == [Status.COMPLETED] * 2


async def test_a_cancel_refuses_later_admissions(policy_url):
    actor = ShardActor(0, partial(make_shard, policy_url), V0, "order")
    async with anyio.create_task_group() as tg:
        tg.start_soon(actor.run)
        await actor.wait_ready()
        await actor.step(2, 1)  # a cancel does not wait for the admission it was told of
        late = GroupSpec("late", size=2, task=task(1), id="late")
        assert await actor.admit([(late, V0)]) == ["late"]
        with anyio.fail_after(10):
            while not (await actor.pull(0.0, 0.25)).done:
                pass
