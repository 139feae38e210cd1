"""`repeat_certain`: a group whose first member was certain plays it once; the rest repeat it."""

from __future__ import annotations

import anyio
import pytest
from free_env import REF, make

from plies import Status, Turn
from plies.rl import REPEATS, GRPOConfig, played, repeat_certain
from plies.rl._grpo import set_aside_reason
from plies.runtime import EnvPool, GroupSpec, RolloutDriver, RolloutResources

pytestmark = pytest.mark.anyio


def recording(events: list[tuple[str, str, int]]):
    """An episode of one turn: certain (every logprob 0) for tasks "sure", "slow" and
    "fails"; member 0 of "fails" raises after it sampled, and "slow" takes a minute."""

    async def episode(ctx):
        events.append(("start", ctx.group_id, ctx.index))
        await anyio.sleep(0.01 if ctx.task != "slow" else 60)
        events.append(("end", ctx.group_id, ctx.index))
        sure = ctx.task in ("sure", "slow", "fails")
        ctx.add_turn(
            Turn(prompt_ids=[1, 2], completion_ids=[3, 4], logprobs=[0.0, 0.0 if sure else -0.5],
                 finish_reason="stop", policy=REF)
        )  # fmt: skip
        if ctx.task == "fails" and ctx.index == 0:
            raise RuntimeError("the env broke after the turn")
        return ctx.trajectory

    return episode


async def test_a_certain_first_member_is_repeated_and_an_uncertain_one_is_not():
    """Member 0 plays first; when it was certain the others copy its record (marked, with
    their own ids) without playing; when it was not, or it failed, they play after it."""
    events: list[tuple[str, str, int]] = []
    specs = [
        GroupSpec("t", size=4, task="sure", id="sure"),
        GroupSpec("t", size=4, task="unsure", id="unsure"),
        GroupSpec("t", size=3, task="fails", id="fails"),
        GroupSpec("t", size=1, task="sure", id="alone"),
    ]
    async with (
        RolloutResources(pools=[EnvPool(make)]) as res,
        RolloutDriver(
            res, repeat_certain(recording(events)), policy=REF, max_groups_in_flight=None
        ) as driver,
    ):
        for spec in specs:
            await driver.admit(spec)
        await driver.stop()
        groups = {g.id: g for g in driver.collect()}
        stats = driver.statistics()
    assert {k: (g.size, len(g.trajectories), played(g)) for k, g in groups.items()} == {
        "sure": (4, 4, 1), "unsure": (4, 4, 4), "fails": (3, 3, 3), "alone": (1, 1, 1),
    }  # fmt: skip
    first, *repeats = groups["sure"].trajectories
    assert REPEATS not in first.info
    for traj in repeats:
        assert traj.info[REPEATS] == first.id and traj.id != first.id
        assert (traj.turns, traj.reward, traj.status) == (first.turns, first.reward, first.status)
        assert (traj.task_id, traj.group_id) == ("t", "sure")
    assert len({t.id for t in groups["sure"].trajectories}) == 4
    assert [(kind, i) for kind, g, i in events if g == "sure"] == [("start", 0), ("end", 0)]
    unsure = [(kind, i) for kind, g, i in events if g == "unsure"]
    assert unsure[:3] == [("start", 0), ("end", 0), ("start", 1)] and len(unsure) == 8
    assert [t.status for t in groups["fails"].trajectories] == [
        Status.FAILED, Status.COMPLETED, Status.COMPLETED,
    ]  # fmt: skip
    # GRPO sets the repeated group aside as certain, one episode's worth, not as tied.
    config = GRPOConfig(steps=1, group_size=4)
    assert set_aside_reason(groups["sure"], REF, config) == "certain"
    assert set_aside_reason(groups["unsure"], REF, config) != "certain"
    assert stats.admitted == 12
    assert stats.turns == 12 - 3  # one turn an episode; the repeats sampled none
    assert stats.settled[Status.COMPLETED] == 11 and stats.settled[Status.FAILED] == 1


async def test_members_waiting_for_a_cancelled_first_member_settle_cancelled():
    events: list[tuple[str, str, int]] = []
    async with (
        RolloutResources(pools=[EnvPool(make)]) as res,
        RolloutDriver(res, repeat_certain(recording(events)), policy=REF) as driver,
    ):
        await driver.admit(GroupSpec("t", size=3, task="slow", id="cut"))
        await anyio.sleep(0.05)
        driver.cancel()
        await driver.wait_drained()
        (cut,) = driver.collect()
    assert cut.size == 3 and [t.status for t in cut.trajectories] == [Status.CANCELLED] * 3
    assert played(cut) == 3 and events == [("start", "cut", 0)]
