"""Durable writes leave the event loop free: quarantine bursts, group commits, write failures.

The quarantine report and the sink are real files here; the pools are real pools whose
teardowns fail. A probe task measures how late the loop wakes it (the loop's worst stall).
Noise on a loaded machine only ever adds lateness, so a stall check passes if one of a few
attempts stays under the bound.
"""

from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path

import anyio
import pytest
from free_env import REF
from free_env import make as quiet

from plies import Group, Status
from plies.runtime import (
    EnvPool,
    GroupSpec,
    JsonlSink,
    RolloutDriver,
    RolloutResources,
    long_run_collector,
    read_jsonl,
)
from plies.runtime._report import read_report

pytestmark = [pytest.mark.anyio, pytest.mark.serial]  # loop stalls: measured alone

QUARANTINES = 1024
STALL_BOUND = 0.050
ATTEMPTS = 3
PERIOD = 0.002


class Thing:
    async def aclose(self) -> None:
        raise RuntimeError("teardown refused")


async def make() -> Thing:
    return Thing()


class StallProbe:
    """Sleeps `PERIOD` again and again and keeps the worst lateness of its wake-ups."""

    def __init__(self) -> None:
        self.worst = 0.0

    async def run(self) -> None:
        while True:
            start = time.perf_counter()
            await anyio.sleep(PERIOD)
            self.worst = max(self.worst, time.perf_counter() - start - PERIOD)


async def quarantine_burst(report_path: Path, seed: int) -> float:
    """1,024 leases come back within one second; every teardown fails. Worst stall, s.

    Each quarantine changes the report, and each change used to rewrite and fsync the whole
    report on the loop.
    """
    pool = EnvPool(make, limit=2 * QUARANTINES, teardown_retries=1, retry_backoff=0.05)
    probe = StallProbe()
    rng = random.Random(seed)
    async with (
        RolloutResources(pools=[pool], report_path=report_path) as res,
        anyio.create_task_group() as outer,
    ):
        outer.start_soon(probe.run)
        borrowed = anyio.Event()
        go = anyio.Event()
        live = [0]

        async def hold(after: float) -> None:
            async with res.env.borrow():
                live[0] += 1
                if live[0] == QUARANTINES:
                    borrowed.set()
                await go.wait()
                await anyio.sleep(after)

        async with anyio.create_task_group() as tg:
            for _ in range(QUARANTINES):
                tg.start_soon(hold, rng.uniform(0.0, 1.0))
            await borrowed.wait()
            await anyio.sleep(0.05)
            probe.worst = 0.0  # the burst of creates is not what is measured
            go.set()
        with anyio.fail_after(30):  # the background retries fail too, and are reported
            while pool.statistics().quarantined < QUARANTINES or res.writer.pending:
                await anyio.sleep(0.01)
            await anyio.sleep(0.2)
            await res.writer.wait_idle()
        during = read_report(report_path)
        outer.cancel_scope.cancel()
    assert len(during.entries) == QUARANTINES and not during.complete
    assert all(e.reason.startswith("teardown failed") for e in during.entries)
    final = read_report(report_path)
    assert final.complete and len(final.entries) == QUARANTINES
    assert all(e.teardown_attempts == 1 and e.may_exist for e in final.entries)
    return probe.worst


async def test_a_burst_of_1024_quarantines_never_stalls_the_loop(tmp_path):
    stalls = []
    for attempt in range(ATTEMPTS):
        stalls.append(await quarantine_burst(tmp_path / f"quarantine{attempt}.json", attempt))
        if stalls[-1] < STALL_BOUND:
            break
    assert min(stalls) < STALL_BOUND, f"worst loop stalls {stalls} s"


async def burst_of_groups(path: Path) -> float:
    """256 groups completing in one moment: each must be on disk before it is handed out.

    Returns:
        The worst stall of the event loop meanwhile, in seconds.
    """
    gate = anyio.Event()

    async def episode(ctx):
        async with ctx.borrow("env"):
            await gate.wait()  # every group completes in the same moment
        return ctx.trajectory

    probe = StallProbe()
    groups = 256
    async with RolloutResources(pools=[EnvPool(quiet, limit=groups)]) as res:
        with JsonlSink(path) as sink:
            async with RolloutDriver(
                res, episode, policy=REF, max_groups_in_flight=None, sink=sink
            ) as driver:
                for i in range(groups):
                    await driver.admit(GroupSpec(f"t{i}"))
                driver.close_admission()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(probe.run)
                    await anyio.sleep(0.05)
                    probe.worst = 0.0
                    gate.set()
                    seen = []
                    async for group in driver.groups():
                        on_disk = {g.id for g in read_jsonl(path, Group).records}
                        assert group.id in on_disk  # fsynced before it was handed out
                        seen.append(group.task_id)
                    tg.cancel_scope.cancel()
            assert sink.records == groups
    assert sorted(seen) == sorted(f"t{i}" for i in range(groups))
    return probe.worst


async def test_a_group_is_on_disk_before_it_is_handed_out_and_bursts_share_fsyncs(tmp_path):
    # As for the quarantine burst, the bound must hold in one of `ATTEMPTS` bursts: a host
    # busy with other work stalls any loop now and then (a full suite here once saw 0.55 s).
    # A stall of the driver's own making, such as 256 fsyncs on the loop, recurs every time.
    # The collector is set as `plies.runtime.run` sets it for a long run: the test process
    # holds torch, transformers and every collected module, and one full collection of that
    # heap (0.15-0.5 s on a busy host) is no stall of the driver's making.
    stalls = []
    with long_run_collector():
        for attempt in range(ATTEMPTS):
            stalls.append(await burst_of_groups(tmp_path / f"groups{attempt}.jsonl"))
            if stalls[-1] < 0.5:
                break
    assert min(stalls) < 0.5, f"worst loop stalls {stalls} s"


async def test_a_sink_that_cannot_write_raises_from_groups(tmp_path):
    async def episode(ctx):
        async with ctx.borrow("env"):
            await anyio.lowlevel.checkpoint()
        return ctx.trajectory

    sink = JsonlSink("/dev/full").open()  # every write fails with ENOSPC
    try:
        async with RolloutResources(pools=[EnvPool(quiet)]) as res:
            with pytest.raises(OSError, match="No space left"):
                async with RolloutDriver(res, episode, policy=REF, sink=sink) as driver:
                    await driver.admit(GroupSpec("t"))
                    driver.close_admission()
                    async for _ in driver.groups():
                        pass
            stats = driver.statistics()
    finally:
        with contextlib.suppress(OSError):  # /dev/full cannot be fsynced either
            sink.close()
    assert stats.settled[Status.COMPLETED] == 1 and stats.groups_complete == 0
