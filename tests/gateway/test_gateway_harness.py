"""`GatewayHarness` with the example agent: exact turns, env rewards, cleanup on every path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from gateway_kit import gateway_stack
from test_gateway_http import assert_recorded_exactly, call_ids

from plies import Status
from plies.environments import BlackjackEnv, Task
from plies.harness import GatewayHarness
from plies.runtime import EnvPool, RolloutResources

pytestmark = pytest.mark.anyio

AGENT = [sys.executable, str(Path(__file__).parents[2] / "examples" / "gateway_agent.py"), "agent"]


async def test_example_agent_plays_blackjack_through_the_gateway(policy_server, qwen3_tokenizer):
    task = Task(id="hand-7", seed=7)
    async with BlackjackEnv() as reference:  # the same hand, played directly
        await reference.reset(task)
        await reference.call_tool("hit", {})
        expected = (await reference.call_tool("stand", {})) if not reference.done else None

    async with gateway_stack(policy_server, qwen3_tokenizer) as stack:
        stack.engine.queue(call_ids(qwen3_tokenizer, "hit", "{}"))
        stack.engine.queue(call_ids(qwen3_tokenizer, "stand", "{}"))
        harness = GatewayHarness(stack.server, AGENT, wall_s=60)
        async with BlackjackEnv() as env:
            trajectory = await harness.run(env, task, group_id="g")
        assert stack.gateway.open_sessions == 0

    assert trajectory.status is Status.COMPLETED and trajectory.group_id == "g"
    assert trajectory.info["env_done"] is True
    played = trajectory.info["tool_calls"]
    assert played == (2 if expected is not None else 1)
    assert trajectory.reward == (expected.reward if expected is not None else trajectory.reward)
    assert_recorded_exactly(trajectory, stack.engine)
    assert [t.extends for t in trajectory.turns] == [False, True][: len(trajectory.turns)]


async def test_warm_policy_plays_through_the_gateway_with_sampled_tool_calls(
    warm_server, qwen3_tokenizer
):
    """No scripted answers: the demo's warm-started policy samples every tool call."""
    from plies.recipes.blackjack.config import SYSTEM_PROMPT, TEMPLATE_KWARGS

    async with gateway_stack(
        warm_server,
        qwen3_tokenizer,
        max_tokens=32,
        template_kwargs=dict(TEMPLATE_KWARGS),
        policy=f"policy-{warm_server.warm.version}",  # the served name of the warm start
    ) as stack:
        harness = GatewayHarness(stack.server, [*AGENT, "--system", SYSTEM_PROMPT], wall_s=60)
        trajectories = []
        for seed in range(4):
            async with BlackjackEnv() as env:
                trajectories.append(await harness.run(env, Task(id=f"w{seed}", seed=seed)))
        assert not stack.engine.script and stack.gateway.open_sessions == 0

    offset = 0
    for trajectory in trajectories:  # hands ran one after another: answers are in order
        for k, turn in enumerate(trajectory.turns):
            ids, logprobs = stack.engine.sampled(offset + k)
            assert (turn.completion_ids, turn.logprobs) == (ids, logprobs)
            assert trajectory.prompt_ids(k) == stack.engine.requests[offset + k]["prompt"]
            assert turn.policy == warm_server.warm
        offset += len(trajectory.turns)
    assert offset == len(stack.engine.answers)
    finished = [t for t in trajectories if t.info["env_done"]]
    assert len(finished) >= 3, [(t.status, t.error, t.info, len(t.turns)) for t in trajectories]
    for trajectory in finished:
        assert trajectory.status is Status.COMPLETED and trajectory.reward in (-1.0, 0.0, 1.0)
        assert trajectory.info["tool_calls"] >= 1


@pytest.mark.parametrize(
    ("code", "status", "error"),
    [
        ("import sys; sys.stderr.write('boom'); sys.exit(3)", Status.FAILED, "exited with 3"),
        ("import time; time.sleep(600)", Status.TRUNCATED, "wall_s"),
        ("print('not json', flush=True); input()", Status.FAILED, "JSONDecodeError"),
    ],
    ids=["crash", "hang", "garbage"],
)
async def test_failing_agents_settle_and_are_killed(
    policy_server, qwen3_tokenizer, code, status, error
):
    async with gateway_stack(policy_server, qwen3_tokenizer) as stack:
        harness = GatewayHarness(
            stack.server, [sys.executable, "-c", code], wall_s=3, kill_timeout=1
        )
        async with BlackjackEnv() as env:
            trajectory = await harness.run(env, Task(id="bad", seed=1))
        assert stack.gateway.open_sessions == 0
    assert trajectory.status is status
    assert error in trajectory.error
    assert trajectory.turns == [] and trajectory.info["tool_reward"] is None  # no tool call
    # A failure of the agent keeps no reward; one cut off by wall_s is scored (unpaid: 0.0).
    assert trajectory.reward == (0.0 if status is Status.TRUNCATED else None)


class Watched(BlackjackEnv):
    """Records which operations its lease had in flight at each remote call."""

    def __init__(self) -> None:
        super().__init__()
        self.lease = None
        self.seen: list[tuple[str, ...]] = []

    async def reset(self, task):
        self.seen.append(self.lease.in_flight)
        return await super().reset(task)

    async def call_tool(self, name, arguments):
        self.seen.append(self.lease.in_flight)
        return await super().call_tool(name, arguments)


async def test_reset_and_tool_calls_run_inside_the_lease_s_operations(
    policy_server, qwen3_tokenizer
):
    async def make() -> Watched:
        return Watched()

    async with gateway_stack(policy_server, qwen3_tokenizer) as stack:
        stack.engine.queue(call_ids(qwen3_tokenizer, "stand", "{}"))
        harness = GatewayHarness(stack.server, AGENT, wall_s=60)
        pool = EnvPool(make)
        async with RolloutResources(pools=[pool]), pool.borrow() as lease:
            env = lease.resource
            env.lease = lease
            trajectory = await harness.run(env, Task(id="hand-7", seed=7), lease=lease)
    assert trajectory.status is Status.COMPLETED and trajectory.info["tool_calls"] == 1
    assert env.seen == [("reset",), ("tool:stand",)]
    assert trajectory.reward is not None
