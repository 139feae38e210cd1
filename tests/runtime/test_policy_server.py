"""Killing the real policy server (`plies serve`) mid-run fails episodes with a typed error."""

from __future__ import annotations

import signal

import anyio
import httpx
import pytest
from runtime_helpers import OpProcess, kill_group, spawn_op_server, take

from plies import PolicyRef, RetryPolicy, Status, Turn
from plies.policy import SamplingParams, Timeout, VLLMClient
from plies.runtime import EnvPool, GroupSpec, RolloutDriver, RolloutResources
from plies.testing import plies_command, process_alive, serve_process_sync
from plies.tokens import PromptDelta


@pytest.fixture
def policy_server(tiny_model_dir, tmp_path):
    argv = plies_command("serve", str(tiny_model_dir), "--port", "0", "--threads", "1")
    with serve_process_sync(argv, log=tmp_path / "serve.log") as server:
        yield server.process, server.ready


@pytest.mark.anyio
@pytest.mark.timeout(180)
async def test_killing_the_policy_server_fails_episodes_with_a_typed_error(policy_server):
    server, info = policy_server
    ref = PolicyRef.model_validate(info["policy"])
    params = SamplingParams(max_tokens=2, temperature=1.0)
    made: list[OpProcess] = []

    async def create() -> OpProcess:
        made.append(await spawn_op_server())
        return made[-1]

    async def episode(ctx):
        prompt = [1, 2, 3]
        async with ctx.borrow("env") as lease, httpx.AsyncClient() as http:
            for k in range(10_000):  # runs until the policy fails it
                c = await ctx.sampler.sample(prompt, params, policy=ctx.policy)
                ctx.add_turn(Turn.from_completion(PromptDelta(prompt if k == 0 else [4], k > 0), c))
                async with lease.operation("step"):
                    (await http.get(f"{lease.resource.url}/op")).raise_for_status()
        return ctx.trajectory

    client = VLLMClient(
        info["url"],
        info["model"],
        policy=ref,
        timeout=Timeout(connect=2, read=30),
        retry=RetryPolicy(attempts=2, initial_wait=0.05, max_wait=0.1),
    )
    pool = EnvPool(create, kind="process", limit=4)
    try:
        async with client, RolloutResources(sampler=client, pools=[pool]) as res:
            async with RolloutDriver(res, episode, policy=ref) as driver:
                await driver.admit(GroupSpec("a", size=2))
                await driver.admit(GroupSpec("b", size=2))
                with anyio.fail_after(60):
                    while driver.statistics().turns < 8:
                        await anyio.sleep(0.05)
                server.send_signal(signal.SIGKILL)
                with anyio.fail_after(60):  # nothing hangs
                    groups = [g async for g in take(driver, 2)]
                stats = driver.statistics()
            assert stats.running == 0 and stats.settled[Status.FAILED] == 4
            for group in groups:
                assert group.policy == ref
                for traj in group.trajectories:
                    assert traj.status is Status.FAILED
                    assert traj.error.split(":")[0] in (
                        "plies.PolicyUnavailable",
                        "plies.PolicyOutcomeUnknown",
                    ), traj.error
                    assert all(t.policy == ref for t in traj.turns)
            assert sum(len(t.turns) for g in groups for t in g.trajectories) == stats.turns
            leases = res.statistics()
            assert leases.borrowed == 4 and leases.released == 4 and leases.quarantined == 0
            assert leases.balanced and leases.live == 0
        assert not any(process_alive(p.pid) for p in made)
    finally:
        for proc in made:
            kill_group(proc.pid)
