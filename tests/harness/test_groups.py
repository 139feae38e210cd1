"""`EnvGroup` and `play_groups` against the real reference server (the random tiny model).

The random model never finishes a turn within a few tokens, so every member is cut off at
`max_tokens`: exactly the first group a new user plays, which must come back trainable.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest
from transformers import AutoTokenizer

from plies import ConfigError, EnvError, Group, PolicyRef, Status, Trajectory
from plies._lifecycle import OpenState
from plies.environments import Env, Observation, Task, ToolResult, tool
from plies.harness import EnvGroup, StopReason, ToolCallingHarness, play_groups
from plies.harness.groups import DEFAULT_GROUP_SIZE
from plies.policy import SamplingParams, VLLMClient
from plies.runtime import JsonlSink, RemoteRef, read_jsonl
from plies.tokens import ChatRenderer
from plies.training import training_groups

pytestmark = pytest.mark.anyio

FEW_TOKENS = SamplingParams(max_tokens=4)


class Log:
    """What happened, in order, across every env and group of one test."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.envs: list[Counter] = []
        self.live = self.peak = 0


class Counter(Env):
    """Counts up; `add` pays its argument. Records its life in a shared `Log`."""

    def __init__(self, log: Log, group: str) -> None:
        super().__init__()
        self.log, self.group = log, group
        log.envs.append(self)
        log.events.append(("made", group))
        log.live += 1
        log.peak = max(log.peak, log.live)

    async def setup(self, task: Task) -> Observation:
        return Observation(messages=[{"role": "user", "content": "Add numbers until 10."}])

    @tool
    async def add(self, n: int) -> ToolResult:
        """Add n."""
        return ToolResult(content="ok", reward=float(n))

    async def teardown(self) -> None:
        self.log.live -= 1
        self.log.events.append(("closed", self.group))


class Tracked(EnvGroup):
    """A group whose members share one `Log`, scored by rank, cleaned up into the log."""

    def __init__(self, log: Log, task: Task, *, size: int, bonus: float = 0.0):
        super().__init__(task, lambda: Counter(log, task.id), size=size)
        self.log, self.bonus = log, bonus
        self.cleanups = 0

    async def group_rewards(self, trajectories: Sequence[Trajectory]) -> list[float]:
        return [self.bonus * i for i in range(len(trajectories))]

    async def cleanup(self) -> None:
        self.cleanups += 1
        mine = [e for e in self.log.envs if e.group == self.task.id]
        assert all(e.lifecycle is OpenState.CLOSED for e in mine), "members still open"
        self.log.events.append(("cleanup", self.task.id))


@pytest.fixture(scope="module")
def renderer(tiny_model_dir: Path) -> ChatRenderer:
    return ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_dir))


@pytest.fixture
async def harness(policy_server, renderer):
    async with VLLMClient(policy_server.url, policy_server.model) as client:
        yield ToolCallingHarness(renderer, client, FEW_TOKENS)


@pytest.fixture
def base(policy_server) -> PolicyRef:
    return PolicyRef.model_validate(policy_server.policy)


def tasks(n: int) -> list[Task]:
    return [Task(id=f"count-{k}", seed=k) for k in range(n)]


async def test_the_default_group_of_a_custom_env_trains(harness, base):
    """Plain `EnvGroup`s of a new env under default settings: no member lacks a reward."""
    made: list[Counter] = []
    log = Log()

    def counter() -> Counter:
        made.append(Counter(log, "plain"))
        return made[-1]

    groups = await play_groups(harness, [EnvGroup(t, counter) for t in tasks(2)], policy=base)
    assert [g.task_id for g in groups] == ["count-0", "count-1"]
    assert all(g.complete and g.size == DEFAULT_GROUP_SIZE for g in groups)
    for traj in (t for g in groups for t in g.trajectories):
        assert (traj.status, traj.info["stop_reason"]) == (
            Status.TRUNCATED, StopReason.MAX_NEW_TOKENS,
        )  # fmt: skip
        assert traj.reward == 0.0 and traj.info["tool_reward"] is None
        assert traj.info["group_reward"] == 0.0 and traj.policies == {base}
    selection = training_groups(groups, policy=base, max_staleness=0)
    assert selection.refused == [] and len(selection.trainable) == 2
    assert len(made) == 2 * DEFAULT_GROUP_SIZE
    assert all(env.lifecycle is OpenState.CLOSED for env in made)


async def test_group_rewards_are_added_and_cleanup_follows_the_last_member(harness, base, tmp_path):
    log = Log()
    owners = [Tracked(log, t, size=3, bonus=0.5) for t in tasks(2)]
    with JsonlSink(tmp_path / "groups.jsonl") as sink:
        groups = await play_groups(harness, owners, policy=base, sink=sink)
    for group in groups:
        assert [t.reward for t in group.trajectories] == [0.0, 0.5, 1.0]
        assert [t.info["group_reward"] for t in group.trajectories] == [0.0, 0.5, 1.0]
    assert [o.cleanups for o in owners] == [1, 1]
    for owner in owners:  # each cleanup came after its own members were made and closed
        mine = [e for e in log.events if e[1] == owner.task.id]
        assert mine[-1] == ("cleanup", owner.task.id)
        assert sorted(mine[:-1]) == [("closed", owner.task.id)] * 3 + [("made", owner.task.id)] * 3
    written = read_jsonl(tmp_path / "groups.jsonl", Group)
    # Written as they complete, returned in task order: the same groups, in either order.
    by_id = {g.id: g.model_dump() for g in groups}
    assert written.clean and len(written.records) == len(groups)
    assert {g.id: g.model_dump() for g in written.records} == by_id


async def test_groups_in_flight_are_bounded(harness, base):
    log = Log()
    owners = [Tracked(log, t, size=2) for t in tasks(3)]
    groups = await play_groups(harness, owners, policy=base, max_groups_in_flight=1)
    assert len(groups) == 3 and log.peak <= 2
    order = [e for e in log.events if e[0] != "closed"]
    assert order == [(kind, t.id) for t in tasks(3) for kind in ("made", "made", "cleanup")]


async def test_a_broken_group_reward_raises_and_every_group_is_still_cleaned_up(harness, base):
    class Short(Tracked):
        async def group_rewards(self, trajectories):
            return [0.0]

    log = Log()
    owners = [Short(log, t, size=2) for t in tasks(3)]
    with pytest.raises(ConfigError, match="returned 1 values for 2 members"):
        await play_groups(harness, owners, policy=base, max_groups_in_flight=1)
    assert [o.cleanups for o in owners] == [1, 1, 1]  # the two never played too
    assert log.live == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "0.5"])
async def test_non_finite_group_rewards_are_refused(harness, base, bad):
    class Bad(Tracked):
        async def group_rewards(self, trajectories):
            return [bad] * len(trajectories)

    with pytest.raises(ConfigError, match="rewards must be finite"):
        await play_groups(harness, [Bad(Log(), tasks(1)[0], size=1)], policy=base)


async def test_a_failed_cleanup_is_an_env_error_naming_what_the_group_holds(harness, base):
    class Leaky(Tracked):
        async def cleanup(self) -> None:
            await super().cleanup()
            raise RuntimeError("sandbox API down")

        def remote_refs(self) -> list[RemoteRef]:
            return [RemoteRef(kind="local-sandbox", id=f"sb-{self.task.id}")]

    log = Log()
    with pytest.raises(EnvError, match=r"sandbox API down.*sb-count-0"):
        await play_groups(harness, [Leaky(log, tasks(1)[0], size=2)], policy=base)
    assert log.live == 0


async def test_a_stalled_cleanup_is_cut_off_and_reported(harness, base):
    class Stalled(Tracked):
        cleanup_timeout_s = 0.2

        async def cleanup(self) -> None:
            await anyio.sleep(30)

    with anyio.fail_after(60), pytest.raises(EnvError, match="TimeoutError"):
        await play_groups(harness, [Stalled(Log(), tasks(1)[0], size=1)], policy=base)


async def test_a_factory_that_makes_no_env_fails_its_members(harness, base):
    groups = await play_groups(harness, [EnvGroup(tasks(1)[0], dict, size=2)], policy=base)
    members = groups[0].trajectories
    assert [t.status for t in members] == [Status.FAILED] * 2
    assert all("not an Env" in t.error and t.reward is None for t in members)
    [refusal] = training_groups(groups, policy=base, max_staleness=0).refused
    assert refusal.reason == "failed_member"


async def test_async_factories_and_make_env_overrides_are_both_used(harness, base):
    async def make() -> Counter:
        return Counter(log, "async")

    class Own(EnvGroup):
        async def make_env(self) -> Env:
            return Counter(log, "override")

    log = Log()
    await play_groups(
        harness, [EnvGroup(tasks(1)[0], make, size=1), Own(tasks(2)[1], size=1)], policy=base
    )
    assert sorted(g for kind, g in log.events if kind == "made") == ["async", "override"]


def test_bad_groups_are_refused_with_what_to_change():
    with pytest.raises(ConfigError, match=r"needs a plies\.environments\.Task"):
        EnvGroup("count-0", Counter)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="at least 1"):
        EnvGroup(tasks(1)[0], Counter, size=0)


async def test_the_same_group_twice_and_a_group_without_envs_are_refused(harness, base):
    group = EnvGroup(tasks(1)[0], dict)
    with pytest.raises(ConfigError, match="same EnvGroup twice"):
        await play_groups(harness, [group, group], policy=base)
    groups = await play_groups(harness, [EnvGroup(tasks(1)[0], size=1)], policy=base)
    assert "needs an env factory" in groups[0].trajectories[0].error
