"""Blackjack in one sandbox per episode: a local process backend and a stand-in E2B cloud."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import anyio
import httpx
import pytest
from _e2b_fake import FakeE2BCloud

from plies import SandboxError
from plies.environments import (
    BlackjackEnv,
    E2BBackend,
    LocalProcessBackend,
    SandboxedBlackjackEnv,
    Task,
)
from plies.environments.sandboxed import GAME_FILE, STATE_FILE, game_script
from plies.runtime import EnvPool, RolloutResources
from plies.runtime._lease import LeaseState
from plies.runtime._report import read_report

pytestmark = pytest.mark.anyio


@pytest.fixture
def cloud(tmp_path) -> FakeE2BCloud:
    root = tmp_path / "e2b"
    root.mkdir()
    return FakeE2BCloud(root)


@pytest.fixture(params=["local", "e2b"])
def backend_and_leftovers(request, tmp_path, cloud):
    """A backend, and a function listing the sandboxes it still holds."""
    if request.param == "local":
        root = tmp_path / "local"
        root.mkdir()
        return LocalProcessBackend(root), lambda: sorted(p.name for p in root.iterdir())
    return E2BBackend(sandbox_cls=cloud.sandbox_class), lambda: sorted(cloud.sandboxes)


async def play(env, task: Task) -> list:
    """Hit below 17; returns every result, the opening observation first."""
    obs = await env.reset(task)
    steps, info = [obs], obs.info
    while not getattr(steps[-1], "done", False):
        steps.append(await env.call_tool("hit" if info["player_total"] < 17 else "stand", {}))
        info = steps[-1].info
    return steps


async def test_same_hands_as_in_process_and_every_sandbox_released(backend_and_leftovers):
    backend, leftovers = backend_and_leftovers
    seen_ids: list[str] = []

    async def episode(seed: int) -> None:
        task = Task(id=f"hand-{seed}", seed=seed)
        async with SandboxedBlackjackEnv(backend, run_id="run-1") as env, BlackjackEnv() as local:
            got = await play(env, task)
            (ref,) = env.remote_refs()
            assert (ref.kind, ref.id) == (backend.kind, env.sandbox_id)
            assert ref.detail["run_id"] == "run-1"
            assert ref.detail["episode_id"].startswith(f"hand-{seed}-")
            seen_ids.append(ref.id)
            want = await play(local, task)
        assert env.remote_refs() == [] and env.sandbox_id is None
        assert got[0].messages == want[0].messages and got[0].info == want[0].info
        assert [(s.content, s.reward, s.done, s.info) for s in got[1:]] == [
            (s.content, s.reward, s.done, s.info) for s in want[1:]
        ]

    async with anyio.create_task_group() as tg:
        for seed in range(6):
            tg.start_soon(episode, seed)
    assert len(set(seen_ids)) == 6
    assert leftovers() == []


async def test_group_members_never_share_a_sandbox(cloud):
    backend = E2BBackend(sandbox_cls=cloud.sandbox_class)
    task = Task(id="same-task", seed=4)
    async with (
        SandboxedBlackjackEnv(backend, run_id="r") as a,
        SandboxedBlackjackEnv(backend, run_id="r") as b,
    ):
        await a.reset(task)
        await b.reset(task)
        assert a.sandbox_id != b.sandbox_id and cloud.creates == 2
    assert cloud.sandboxes == {}


async def test_a_cancelled_reset_still_releases_its_sandbox(tmp_path):
    slow = tmp_path / "slow-python"
    slow.write_text(f'#!/bin/sh\nsleep 30\nexec {sys.executable} "$@"\n')
    slow.chmod(0o755)
    root = tmp_path / "sandboxes"
    env = SandboxedBlackjackEnv(LocalProcessBackend(root), run_id="r", python=str(slow))
    with anyio.move_on_after(1.0) as scope:
        await env.reset(Task(id="t", seed=1))
    assert scope.cancelled_caught
    assert env.sandbox_id is not None and Path(env.sandbox_id).exists()
    await env.close()
    assert list(root.iterdir()) == []


async def test_the_script_refuses_illegal_moves(tmp_path):
    sandbox = await LocalProcessBackend(tmp_path).create(run_id="r", episode_id="e")
    try:
        await sandbox.write_file(GAME_FILE, game_script())
        run = [sys.executable, GAME_FILE, STATE_FILE]
        assert (await sandbox.run([*run, "new", "9"], timeout_s=20)).exit_code == 0
        assert (await sandbox.run([*run, "stand"], timeout_s=20)).exit_code == 0
        again = await sandbox.run([*run, "stand"], timeout_s=20)
        assert again.exit_code == 2 and "the hand is over" in again.stderr
        usage = await sandbox.run([*run, "fold"], timeout_s=20)
        assert usage.exit_code == 2 and "usage" in usage.stderr
    finally:
        await sandbox.kill()


async def test_a_vanished_sandbox_fails_the_episode_and_close_still_succeeds(cloud):
    env = SandboxedBlackjackEnv(E2BBackend(sandbox_cls=cloud.sandbox_class), run_id="r")
    await env.reset(Task(id="t", seed=2))
    sandbox_id = env.sandbox_id
    cloud.vanish(sandbox_id)
    with pytest.raises(SandboxError, match="SandboxNotRunningException") as err:
        await env.call_tool("hit", {})
    assert err.value.sandbox_id == sandbox_id
    await env.close()  # kill answers False: already gone, nothing to report
    assert env.remote_refs() == []


async def test_a_failed_kill_is_reported_with_the_sandbox_id_and_can_be_retried(cloud):
    env = SandboxedBlackjackEnv(E2BBackend(sandbox_cls=cloud.sandbox_class), run_id="r")
    await env.reset(Task(id="t", seed=2))
    sandbox_id = env.sandbox_id
    cloud.kill_error = httpx.ConnectError("connection refused")
    with pytest.raises(SandboxError, match="could not be reached to kill") as err:
        await env.close()
    assert err.value.sandbox_id == sandbox_id
    assert [r.id for r in env.remote_refs()] == [sandbox_id]  # what a quarantine report lists
    cloud.kill_error = None
    await env.close()
    assert cloud.sandboxes == {} and env.remote_refs() == []


async def test_a_failed_create_leaves_nothing_behind(cloud):
    from e2b import ServiceBusyException

    cloud.create_error = ServiceBusyException("no capacity to place a sandbox")
    backend = E2BBackend(sandbox_cls=cloud.sandbox_class)
    async with SandboxedBlackjackEnv(backend, run_id="r") as env:
        with pytest.raises(SandboxError, match="ServiceBusyException"):
            await env.reset(Task(id="t", seed=2))
        assert env.remote_refs() == []
    assert cloud.sandboxes == {}


async def test_a_quarantined_env_names_its_sandbox_and_plies_reap_kills_it(tmp_path):
    """The sandbox is made in reset, after the pool created the env; the report still names it."""
    root = tmp_path / "local"
    root.mkdir()
    report_path = tmp_path / "quarantine.json"

    async def make_env() -> SandboxedBlackjackEnv:
        return SandboxedBlackjackEnv(LocalProcessBackend(root), run_id="reap-test")

    pool = EnvPool(make_env, settle_timeout=0.2, teardown_retries=0)
    async with (
        RolloutResources(pools=[pool], report_path=report_path) as res,
        res.pool("env").borrow() as lease,
    ):
        async with lease.operation("reset"):
            await lease.resource.reset(Task(id="hand", seed=1))
        with anyio.move_on_after(0.3):
            async with lease.operation("hit"):
                await anyio.sleep(30)  # a tool call that hangs past settle_timeout
    assert lease.state is LeaseState.QUARANTINED
    (entry,) = read_report(report_path).may_exist
    assert (entry.kind, entry.remote_id) == ("local-sandbox", lease.resource.sandbox_id)
    assert Path(entry.remote_id).exists()

    plies = Path(sys.executable).with_name("plies")
    reap = subprocess.run(
        [str(plies), "reap", str(report_path)], capture_output=True, text=True, timeout=60
    )
    assert reap.returncode == 0, reap.stdout + reap.stderr
    assert not Path(entry.remote_id).exists()
    assert read_report(report_path).may_exist == []
