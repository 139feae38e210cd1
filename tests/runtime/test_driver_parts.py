"""Pacing, admission, sinks and the live display, in process."""

from __future__ import annotations

import io
import itertools

import anyio
import pytest
from anyio import WouldBlock
from free_env import REF, make, quick
from rich.console import Console

from plies import AdmissionClosed, ConfigError, Group, Status, Trajectory, Turn
from plies.runtime import (
    EnvPool,
    GroupSpec,
    JsonlSink,
    RolloutDriver,
    RolloutResources,
    read_jsonl,
)
from plies.runtime._progress import LiveProgress


@pytest.mark.anyio
async def test_pacing_bounds_groups_in_flight_and_nothing_is_dropped(tmp_path):
    sink_path = tmp_path / "groups.jsonl"
    async with RolloutResources(pools=[EnvPool(make)]) as res:
        with JsonlSink(sink_path) as sink:
            async with RolloutDriver(
                res, quick, policy=REF, max_groups_in_flight=2, sink=sink
            ) as driver:
                await driver.admit(GroupSpec("a", size=2))
                await driver.admit(GroupSpec("b", size=2))
                with pytest.raises(WouldBlock):
                    driver.admit_nowait(GroupSpec("c"))
                await driver.wait_drained()
                # Complete but not handed out: still in flight for pacing.
                assert driver.statistics().groups_in_flight == 2
                with pytest.raises(WouldBlock):
                    driver.admit_nowait(GroupSpec("c"))
                first = driver.collect()
                assert {g.task_id for g in first} == {"a", "b"}
                driver.set_policy(REF.model_copy(update={"version": 1}))
                late = await driver.admit(GroupSpec("c"))
                assert late.policy.version == 1
                with pytest.raises(ConfigError):
                    driver.set_policy(REF)
                await driver.stop()
                with pytest.raises(AdmissionClosed):
                    await driver.admit(GroupSpec("d"))
                rest = [g async for g in driver.groups()]
                stats = driver.statistics()
    assert [g.task_id for g in rest] == ["c"] and rest[0].policy.version == 1
    assert stats.settled[Status.COMPLETED] == 5 and stats.groups_in_flight == 0
    assert stats.leases.borrowed == stats.leases.released == 5
    read = read_jsonl(sink_path, Group)
    assert read.clean and sorted(g.task_id for g in read.records) == ["a", "b", "c"]


@pytest.mark.anyio
async def test_admission_waiting_for_capacity_wakes_up_when_stopped():
    async with (
        RolloutResources(pools=[EnvPool(make)]) as res,
        RolloutDriver(res, quick, policy=REF, max_groups_in_flight=1) as driver,
    ):
        await driver.admit(GroupSpec("a"))
        async with anyio.create_task_group() as tg:

            async def blocked():
                with pytest.raises(AdmissionClosed):
                    await driver.admit(GroupSpec("b"))

            tg.start_soon(blocked)
            await anyio.sleep(0.05)
            driver.close_admission()
        assert [g.task_id for g in driver.collect()] == ["a"]


@pytest.mark.anyio
async def test_groups_ready_together_are_handed_out_a_checkpoint_apart(tmp_path):
    """A caller that works on each group without awaiting (building a batch, checking it)
    still lets the loop run other tasks between groups, also when a burst became ready at
    once (one fsync for all of them): else episodes and timers wait for the whole burst."""
    ticks = [0]

    async def ticker() -> None:
        while True:
            await anyio.lowlevel.checkpoint()
            ticks[0] += 1

    async with RolloutResources(pools=[EnvPool(make)]) as res:
        with JsonlSink(tmp_path / "groups.jsonl") as sink:
            async with RolloutDriver(
                res, quick, policy=REF, max_groups_in_flight=None, sink=sink
            ) as driver:
                for i in range(8):
                    await driver.admit(GroupSpec(f"t{i}"))
                driver.close_admission()
                await driver.wait_drained()
                assert driver.statistics().groups_in_flight == 8  # all ready, none handed out
                seen = []
                async with anyio.create_task_group() as tg:
                    tg.start_soon(ticker)
                    await anyio.lowlevel.checkpoint()
                    async for group in driver.groups():
                        seen.append((group.task_id, ticks[0]))
                    tg.cancel_scope.cancel()
    assert sorted(t for t, _ in seen) == [f"t{i}" for i in range(8)]
    between = [b - a for (_, a), (_, b) in itertools.pairwise(seen)]
    assert all(n >= 1 for n in between), between


def test_sink_ends_a_torn_tail_and_the_reader_reports_every_bad_line(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_bytes(b'{"not": "a group"}\n\n{"id": "x", "tas')
    with JsonlSink(path) as sink:
        assert sink.repaired_tail
        sink.write({"id": "y"})
    read = read_jsonl(path, Group)
    assert read.records == []
    assert [(m.line, m.torn) for m in read.malformed] == [
        (1, False),
        (2, False),
        (3, False),
        (4, False),
    ]
    assert read.malformed[1].error == "empty line"
    assert read.malformed[2].preview == '{"id": "x", "tas'
    path.write_bytes(b'{"id": "x", "tas')
    (torn,) = read_jsonl(path, Group).malformed
    assert torn.torn and torn.offset == 0


def test_a_record_whose_turn_lengths_disagree_is_a_malformed_line(tmp_path):
    """`TrajectoryError` is not a `ValueError`: the reader still reports it per line."""
    traj = Trajectory(task_id="t", group_id="g")
    traj.turns.append(
        Turn(prompt_ids=[1, 2], completion_ids=[3, 4], logprobs=[-0.1, -0.2],
             finish_reason="stop", policy=REF)
    )  # fmt: skip
    traj.settle(Status.COMPLETED, reward=1.0)
    good = Group(id="g", task_id="t", size=1, policy=REF, trajectories=[traj]).model_dump_json()
    bad = good.replace("[-0.1,-0.2]", "[-0.1]")
    assert bad != good
    path = tmp_path / "g.jsonl"
    path.write_text(f"{good}\n{bad}\n{good}\n")
    read = read_jsonl(path, Group)
    assert len(read.records) == 2
    [line] = read.malformed
    assert line.line == 2 and "2 completion ids but 1 logprobs" in line.error


@pytest.mark.anyio
async def test_live_progress_draws_on_a_terminal_only():
    async with (
        RolloutResources(pools=[EnvPool(make)]) as res,
        RolloutDriver(res, quick, policy=REF) as driver,
    ):
        out = io.StringIO()
        term = Console(file=out, force_terminal=True, color_system=None, width=200)
        async with LiveProgress(driver, console=term, refresh_s=0.02) as progress:
            assert progress.enabled
            await driver.admit(GroupSpec("a", size=3))
            await driver.wait_drained()
            await anyio.sleep(0.1)
        assert "admitted 3 | running 0 | settled 3 (completed=3)" in out.getvalue()
        pipe = io.StringIO()
        async with LiveProgress(driver, console=Console(file=pipe)) as progress:
            assert not progress.enabled
        assert pipe.getvalue() == ""


def test_the_reader_reads_free_form_records_and_reports_what_is_not_an_object(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 0.5}\n[1, 2]\nnot json\n{"step": 2}\n{"st')
    read = read_jsonl(path)
    assert read.records == [{"step": 1, "loss": 0.5}, {"step": 2}]
    assert [(m.line, m.torn) for m in read.malformed] == [(2, False), (3, False), (5, True)]
    assert "not an object" in read.malformed[0].error


@pytest.mark.anyio
async def test_an_episode_that_settled_its_own_record_gets_the_driver_s_ids_on_a_copy():
    returned: list[Trajectory] = []

    async def settles_itself(ctx):
        traj = Trajectory(task_id="elsewhere")
        traj.settle(Status.TRUNCATED, reward=0.5)
        returned.append(traj)
        return traj

    async with (
        RolloutResources(pools=[EnvPool(make)]) as res,
        RolloutDriver(res, settles_itself, policy=REF) as driver,
    ):
        await driver.admit(GroupSpec("t", id="g"))
        await driver.stop()
        ((member,),) = [g.trajectories for g in driver.collect()]
    assert (member.task_id, member.group_id, member.status, member.reward) == (
        "t",
        "g",
        Status.TRUNCATED,
        0.5,
    )
    assert (returned[0].task_id, returned[0].group_id) == ("elsewhere", "")
