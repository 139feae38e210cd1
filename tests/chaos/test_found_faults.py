"""The defects the chaos trials found, each pinned by a small test of its own.

- A full disk took part of a group's line, then refused the rest: the torn line stayed in
  `groups.jsonl`, so the file no longer read back whole and a resumed run met a malformed line.
- A group whose write failed while the consumer of `groups()` was busy with the previous
  group (training on it) was never reported: `groups()` went back to waiting, and the run hung.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import anyio
import pytest

from plies import Group, PolicyRef, Trajectory
from plies.runtime import GroupSpec, JsonlSink, RolloutDriver, RolloutResources, read_jsonl

POLICY = PolicyRef(uri="plies://chaos/policies/0", version=0)


def group(n: int) -> Group:
    traj = Trajectory(task_id=f"t{n}", group_id=f"g{n}", reward=1.0)
    return Group(id=f"g{n}", task_id=f"t{n}", size=1, policy=POLICY, trajectories=[traj])


@pytest.fixture
def full_disk(monkeypatch: pytest.MonkeyPatch):
    """`fill(path, after)`: writes to `path` succeed `after` times, then one is cut short and
    every later one fails with ENOSPC, as `write(2)` behaves when a disk fills up."""
    real_write = os.write

    def fill(path: Path, after: int) -> None:
        target = str(path.resolve())
        state = {"left": after, "full": False}

        def write(fd: int, data) -> int:
            if os.readlink(f"/proc/self/fd/{fd}") != target:
                return real_write(fd, data)
            if state["full"]:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if state["left"]:
                state["left"] -= 1
                return real_write(fd, data)
            state["full"] = True
            return real_write(fd, memoryview(data)[: len(data) // 2])

        monkeypatch.setattr(os, "write", write)

    return fill


def test_a_write_cut_short_by_a_full_disk_leaves_no_torn_line(tmp_path, full_disk):
    path = tmp_path / "groups.jsonl"
    with JsonlSink(path) as sink:
        sink.write_group(group(0))
        full_disk(path, after=0)
        with pytest.raises(OSError) as raised:
            sink.write_group(group(1))
        assert raised.value.errno == errno.ENOSPC
    read = read_jsonl(path, Group)
    assert read.malformed == []
    assert [g.id for g in read.records] == ["g0"]
    assert path.read_bytes().endswith(b"\n")


@pytest.mark.anyio
async def test_groups_raises_a_write_that_failed_while_the_caller_held_a_group(tmp_path, full_disk):
    path = tmp_path / "groups.jsonl"

    async def episode(ctx):
        ctx.trajectory.reward = 1.0
        return ctx.trajectory

    with JsonlSink(path) as sink:
        full_disk(path, after=1)
        async with RolloutResources() as res:
            with pytest.raises(OSError) as raised:  # not a hang
                with anyio.fail_after(30):
                    async with RolloutDriver(res, episode, policy=POLICY, sink=sink) as driver:
                        await driver.admit(GroupSpec("t0", id="g0"))
                        async for handed in driver.groups():
                            # While the caller works on g0, g1 completes and its write fails.
                            await driver.admit(GroupSpec("t1", id="g1"))
                            await driver.wait_drained()
                            assert handed.id == "g0"
    assert raised.value.errno == errno.ENOSPC
    read = read_jsonl(path, Group)
    assert read.malformed == [] and [g.id for g in read.records] == ["g0"]


@pytest.mark.anyio
async def test_a_batch_whose_last_write_fails_leaves_none_of_its_groups(tmp_path, full_disk):
    """Groups that complete together share one write batch; if its last group's write fails,
    every group of the batch is reported failed, so none of them may stay on disk."""
    path = tmp_path / "groups.jsonl"

    async def episode(ctx):
        ctx.trajectory.reward = 1.0
        return ctx.trajectory

    with JsonlSink(path) as sink:
        full_disk(path, after=2)  # g0, then g1 of the batch (g1, g2); g2 finds the disk full
        async with RolloutResources() as res:
            with pytest.raises(OSError):
                async with RolloutDriver(res, episode, policy=POLICY, sink=sink) as driver:
                    driver.admit_nowait(GroupSpec("t0", id="g0"))
                    await driver.wait_drained()
                    assert [g.id for g in driver.collect()] == ["g0"]
                    driver.admit_nowait(GroupSpec("t1", id="g1"))
                    driver.admit_nowait(GroupSpec("t2", id="g2"))
                    await driver.wait_drained()
                    driver.collect()
            assert driver.statistics().groups_complete == 1
    read = read_jsonl(path, Group)
    assert read.malformed == [] and [g.id for g in read.records] == ["g0"]
