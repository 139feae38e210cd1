"""Leases on real local processes: settle, quarantine, hanging teardowns, the report, reap."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import anyio
import httpx
import pytest
from runtime_helpers import OpProcess, kill_group, spawn_op_server, take

from plies import LeaseError, PolicyRef, Status, Trajectory, UsageError
from plies.runtime import (
    EnvPool,
    GroupSpec,
    Pool,
    RemoteRef,
    RolloutDriver,
    RolloutResources,
    SettleWatch,
)
from plies.runtime._lease import LeaseState
from plies.runtime._report import read_report
from plies.testing import process_alive

pytestmark = pytest.mark.anyio

PLIES = str(Path(sys.executable).with_name("plies"))
REF = PolicyRef(uri="plies://test/policies/0", version=0)


@pytest.mark.parametrize("shared", [False, True], ids=["own-watcher", "settle-watch"])
async def test_cancel_in_flight_operation_settles_or_quarantines(tmp_path, shared):
    """Cancelled mid-operation: released if the operation settles in time, else quarantined,
    whether the block watches for itself or shares its loop's `SettleWatch`."""
    report_path = tmp_path / "quarantine.json"
    spawned: dict[str, OpProcess] = {}
    pool = EnvPool(spawn_op_server, kind="process", settle_timeout=1.0, retry_backoff=0.05)

    async def episode(ctx):
        async with ctx.borrow("env") as lease, httpx.AsyncClient() as http:
            spawned[ctx.task_id] = lease.resource
            async with SettleWatch() as watch:
                # A finished block leaves the watch as it was: the next one is watched too.
                async with lease.operation("warm-up", watch=watch if shared else None):
                    await anyio.sleep(0)
                async with lease.operation("step", watch=watch if shared else None):
                    r = await http.get(f"{lease.resource.url}/op", params={"s": ctx.task})
                    r.raise_for_status()
            return ctx.trajectory

    try:
        async with RolloutResources(pools=[pool], report_path=report_path) as res:
            async with RolloutDriver(res, episode, policy=REF) as driver:
                await driver.admit(GroupSpec("quick", task=0.6))
                await driver.admit(GroupSpec("slow", task=30))
                with anyio.fail_after(20):
                    while len(spawned) < 2 or driver.statistics().leases.live < 2:
                        await anyio.sleep(0.02)
                await anyio.sleep(0.2)  # both operations are in flight now
                driver.cancel()
                groups = [g async for g in driver.groups()]
                stats = driver.statistics()
            by_task = {g.task_id: g.trajectories[0] for g in groups}
            assert by_task["quick"].status is Status.CANCELLED
            assert by_task["slow"].status is Status.QUARANTINED
            assert by_task["slow"].info["quarantined_leases"][0]["remote_id"] == (
                spawned["slow"].remote_id
            )
            assert stats.settled[Status.CANCELLED] == 1
            assert stats.settled[Status.QUARANTINED] == 1
            assert stats.quarantined == 1
            assert stats.leases.released == 1
            assert stats.leases.borrowed == stats.leases.released + stats.leases.quarantined
            # The report already lists the quarantined lease while the scope is open.
            during = read_report(report_path)
            assert [e.remote_id for e in during.entries] == [spawned["slow"].remote_id]
            assert "did not settle within settle_timeout=1s" in during.entries[0].reason
            assert not during.complete
        report = read_report(report_path)
        assert report.complete
        (entry,) = report.entries
        assert entry.kind == "process" and entry.remote_id == spawned["slow"].remote_id
        # The background teardown retry terminated the quarantined process.
        assert entry.torn_down and entry.teardown_attempts >= 1
        assert not process_alive(spawned["slow"].pid)
        assert not process_alive(spawned["quick"].pid)
    finally:
        for proc in spawned.values():
            kill_group(proc.pid)


async def test_blocks_entered_after_a_watched_cancel_get_their_settle_timeout(tmp_path):
    """A `SettleWatch` that saw its scope cancelled gives each later block `settle_timeout`
    from its start: one that finishes in time settles, one that does not is cut off and its
    lease quarantined. A block naming a watch that is not entered is refused."""
    procs: list[OpProcess] = []

    async def create():
        procs.append(await spawn_op_server())
        return procs[-1]

    async def cancelled_call(lease, http, seconds: float) -> tuple[float, int | None]:
        status = None
        with anyio.CancelScope() as scope:
            async with SettleWatch() as watch:
                scope.cancel()
                with anyio.CancelScope(shield=True):
                    await anyio.sleep(0.05)  # the watcher runs and sees the cancel
                assert watch.cancelled
                started = anyio.current_time()
                async with lease.operation("step", watch=watch):
                    r = await http.get(f"{lease.resource.url}/op", params={"s": seconds})
                    status = r.status_code
                pytest.fail("a cancelled caller goes on past its block")
        assert scope.cancelled_caught
        return anyio.current_time() - started, status

    pool = EnvPool(create, kind="process", settle_timeout=1.0, retry_backoff=0.05)
    try:
        async with RolloutResources(pools=[pool], report_path=tmp_path / "q.json") as res:
            async with res.env.borrow() as quick, httpx.AsyncClient() as http:
                with pytest.raises(UsageError, match="not entered"):
                    async with quick.operation("early", watch=SettleWatch()):
                        pass
                took, status = await cancelled_call(quick, http, 0.3)
                assert status == 200 and 0.3 <= took < 1.0
                assert not quick.unsettled
            assert quick.state is LeaseState.RELEASED
            async with res.env.borrow() as slow, httpx.AsyncClient() as http:
                took, status = await cancelled_call(slow, http, 30)
                assert status is None and 1.0 <= took < 5.0
                assert slow.unsettled
            assert slow.state is LeaseState.QUARANTINED
            assert "did not settle within settle_timeout=1s" in slow.reason
    finally:
        for proc in procs:
            kill_group(proc.pid)


async def test_hanging_teardown_is_quarantined_and_the_run_goes_on(tmp_path):
    """A teardown that never returns is quarantined after its timeout; `plies reap` ends it."""
    report_path = tmp_path / "quarantine.json"
    made: list[OpProcess] = []

    async def create():
        proc = await spawn_op_server()
        made.append(proc)
        return proc

    async def teardown(proc: OpProcess):
        if proc is made[0]:  # the first one's graceful shutdown hangs forever
            async with httpx.AsyncClient(timeout=None) as http:
                await http.post(f"{proc.url}/shutdown", params={"hang": 1})
        await proc.aclose()

    pool = Pool(
        create,
        teardown=teardown,
        name="env",
        kind="process",
        limit=2,
        teardown_timeout=0.5,
        teardown_retries=1,
        retry_backoff=0.05,
    )

    async def episode(ctx):
        async with (
            ctx.borrow(pool) as lease,
            httpx.AsyncClient() as http,
            lease.operation("step"),
        ):
            (await http.get(f"{lease.resource.url}/op")).raise_for_status()
        return ctx.trajectory

    try:
        async with RolloutResources(pools=[pool], report_path=report_path, exit_grace=2) as res:
            async with RolloutDriver(res, episode, policy=REF, max_groups_in_flight=1) as driver:
                with anyio.fail_after(30):
                    for i in range(4):
                        await driver.admit(GroupSpec(f"t{i}"))
                        (group,) = [g async for g in take(driver, 1)]
                        assert group.trajectories[0].status is Status.COMPLETED
                driver.close_admission()
            stats = res.statistics()
            assert stats.borrowed == 4 and stats.released == 3 and stats.quarantined == 1
            assert stats.may_exist == 1
            # The quarantined process keeps its slot, so one slot serves the other three.
            assert stats.pools[0].slots_taken == 1
        report = read_report(report_path)
        (entry,) = report.entries
        assert entry.remote_id == made[0].remote_id
        assert entry.reason == "teardown timed out after 0.5s"
        assert entry.may_exist and entry.teardown_attempts == 1
        assert process_alive(made[0].pid)
        assert not any(process_alive(p.pid) for p in made[1:])

        reap = subprocess.run(
            [PLIES, "reap", str(report_path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert reap.returncode == 0, reap.stdout + reap.stderr
        assert f"killed   process {made[0].remote_id}" in reap.stdout
        assert not process_alive(made[0].pid)
        await made[0].process.aclose()
        after = read_report(report_path)
        assert after.entries[0].torn_down and after.entries[0].reaped_at is not None
        again = subprocess.run(
            [PLIES, "reap", str(report_path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert again.returncode == 0 and "0 remote things may have existed" in again.stdout
    finally:
        for proc in made:
            kill_group(proc.pid)


async def test_create_failure_and_misuse_are_typed():
    async def broken():
        raise OSError("no capacity")

    async def episode(ctx):
        async with ctx.borrow("env"):
            return ctx.trajectory

    pool = EnvPool(broken)
    with pytest.raises(UsageError):
        async with pool.borrow():
            pass
    async with RolloutResources(pools=[pool]) as res:
        async with RolloutDriver(res, episode, policy=REF) as driver:
            await driver.admit(GroupSpec("t", size=2))
            (group,) = [g async for g in take(driver, 1)]
        for traj in group.trajectories:
            assert traj.status is Status.FAILED
            assert traj.error.startswith("plies.LeaseError: pool 'env': create failed")
        assert res.statistics().borrowed == 0
        assert pool.statistics().create_failures == 2
    with pytest.raises(LeaseError):
        async with RolloutResources(pools=[EnvPool(broken)]) as res, res.env.borrow():
            pass


async def test_operation_timeout_quarantines_and_raises(tmp_path):
    proc_holder: list[OpProcess] = []

    async def create():
        proc_holder.append(await spawn_op_server())
        return proc_holder[-1]

    pool = EnvPool(create, kind="process", retry_backoff=0.01)
    try:
        async with RolloutResources(pools=[pool], report_path=tmp_path / "q.json") as res:
            with pytest.raises(LeaseError, match="cut off before it settled"):
                async with (
                    res.env.borrow() as lease,
                    httpx.AsyncClient() as http,
                    lease.operation("slow", timeout=0.3),
                ):
                    await http.get(f"{lease.resource.url}/op", params={"s": 30})
            assert lease.state is LeaseState.QUARANTINED
            assert "within its 0.3s timeout" in lease.reason
            with pytest.raises(UsageError):
                async with lease.operation("again"):
                    pass
        report = json.loads((tmp_path / "q.json").read_text())
        assert report["entries"][0]["torn_down"] is True
    finally:
        for proc in proc_holder:
            kill_group(proc.pid)


async def test_episode_results_and_errors_settle_with_status():
    async def make():
        return object()

    async def episode(ctx):
        if ctx.index == 0:
            traj = Trajectory(task_id="ignored")
            traj.status = Status.TRUNCATED
            return traj
        if ctx.index == 1:
            raise ValueError("bad move")
        return "not a trajectory"

    async with RolloutResources(pools=[EnvPool(make, teardown=lambda r: anyio.sleep(0))]) as res:
        async with RolloutDriver(res, episode, policy=REF) as driver:
            admitted = await driver.admit(GroupSpec("t", size=3))
            assert admitted.policy == REF
            driver.set_policy(REF.model_copy(update={"version": 1}))
            (group,) = [g async for g in take(driver, 1)]
        statuses = [t.status for t in group.trajectories]
        assert statuses == [Status.TRUNCATED, Status.FAILED, Status.FAILED]
        assert group.trajectories[0].task_id == "t" and group.policy.version == 0
        assert group.trajectories[1].error == "builtins.ValueError: bad move"
        assert "returned str, not a Trajectory" in group.trajectories[2].error
        assert group.complete


class TwoProcesses:
    """A resource holding two remote things, named by `remote_refs()` as an `Env` names them."""

    def __init__(self, first: OpProcess, second: OpProcess):
        self.parts = (first, second)

    def remote_refs(self) -> list[RemoteRef]:
        return [RemoteRef(kind="process", id=part.remote_id) for part in self.parts]

    async def aclose(self) -> None:
        for part in self.parts:
            await part.aclose()


async def test_every_remote_thing_a_quarantined_resource_holds_is_reported_and_reaped(tmp_path):
    report_path = tmp_path / "quarantine.json"
    made: list[OpProcess] = []

    async def create() -> TwoProcesses:
        made.append(await spawn_op_server())
        made.append(await spawn_op_server())
        return TwoProcesses(*made[-2:])

    pool = EnvPool(create, settle_timeout=0.2, teardown_retries=0)
    try:
        async with (
            RolloutResources(pools=[pool], report_path=report_path) as res,
            res.pool("env").borrow() as lease,
        ):
            with anyio.move_on_after(0.3):
                async with lease.operation("step"):
                    await anyio.sleep(30)  # a remote call that hangs past settle_timeout
        assert lease.state is LeaseState.QUARANTINED
        (entry,) = read_report(report_path).may_exist
        assert (entry.kind, entry.remote_id) == ("process", made[0].remote_id)
        assert [(ref.kind, ref.id) for ref in entry.also_held] == [("process", made[1].remote_id)]
        assert lease.also_held == entry.also_held  # what the driver copies to the trajectory
        assert all(process_alive(part.pid) for part in made)

        reap = subprocess.run(
            [PLIES, "reap", str(report_path)], capture_output=True, text=True, timeout=60
        )
        assert reap.returncode == 0, reap.stdout + reap.stderr
        assert reap.stdout.count("killed   process") == 2, reap.stdout
        assert not any(process_alive(part.pid) for part in made)
        assert read_report(report_path).may_exist == []
    finally:
        for part in made:
            kill_group(part.pid)
            await part.process.aclose()


async def test_a_resource_whose_remote_refs_raise_is_still_lent_and_recorded(tmp_path):
    """Reading the ids is user code; when it fails the record keeps an unknown id."""
    report_path = tmp_path / "quarantine.json"
    closed: list[bool] = []

    class Unreadable:
        def remote_refs(self) -> list[RemoteRef]:
            raise RuntimeError("lost track of its sandbox")

        async def aclose(self) -> None:
            closed.append(True)

    async def create() -> Unreadable:
        return Unreadable()

    pool = EnvPool(create, kind="sandbox", settle_timeout=0.1, teardown_retries=0)
    async with RolloutResources(pools=[pool], report_path=report_path) as res:
        async with res.pool("env").borrow() as lease, lease.operation("step"):
            pass  # settles: released through aclose
        async with res.pool("env").borrow() as lease:
            with anyio.move_on_after(0.1):
                async with lease.operation("step"):
                    await anyio.sleep(30)
        stats = res.statistics()
    assert closed == [True] and lease.state is LeaseState.QUARANTINED
    assert stats.borrowed == 2 and stats.released == 1 and stats.quarantined == 1
    (entry,) = read_report(report_path).may_exist
    assert (entry.kind, entry.remote_id, entry.also_held) == ("sandbox", None, [])
