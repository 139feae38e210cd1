"""Agent CLIs that speak MCP play a plies env through its tools, served to them per episode.

`McpWorkspaceEnv` serves a `BlackjackEnv`'s `hit` and `stand` over MCP while the agent runs;
the scripted policy answers in Qwen3's tool-call format with the tool the agent lists under the
server's name. The reward is what the env paid for the agent's calls, which must equal what
the same hand pays when played directly.
"""

from __future__ import annotations

import pytest
from agent_kit import DONE, agent_gateway, require_agent

from plies import Status
from plies.environments import BlackjackEnv, LocalProcessBackend, Task
from plies.harness import AgentHarness, McpWorkspaceEnv
from plies.testing import ScriptedPolicy

pytestmark = pytest.mark.anyio


async def _a_hand_that_standing_wins() -> Task:
    """The first seeded hand whose stand pays 1.0, so an unplayed hand (0.0) cannot pass."""
    for seed in range(100):
        task = Task(id=f"hand-{seed}", seed=seed)
        async with BlackjackEnv() as env:
            await env.reset(task)
            if (await env.call_tool("stand", {})).reward == 1.0:
                return task
    raise AssertionError("no hand in 100 seeds is won by standing")


@pytest.mark.parametrize("agent", ["claude-code", "codex"])
async def test_an_agent_cli_plays_a_served_env_through_mcp(agent, qwen3_tokenizer, tmp_path):
    adapter = require_agent(agent)
    task = await _a_hand_that_standing_wins()
    script = [{"tool_calls": [{"name": "mcp__blackjack__stand", "arguments": {}}]}, DONE]
    policy = ScriptedPolicy(qwen3_tokenizer, script)
    async with agent_gateway(policy, qwen3_tokenizer) as server:
        harness = AgentHarness(server, adapter, wall_s=180, max_turns=6)
        env = McpWorkspaceEnv(
            BlackjackEnv(), LocalProcessBackend(tmp_path), run_id="mcp", server_name="blackjack"
        )
        async with env:
            trajectory = await harness.run(env, task)

    detail = (trajectory.error, trajectory.info.get("agent_output"), dict(server.paths))
    assert trajectory.status is Status.COMPLETED, detail
    assert env.env.done, ("the agent's call reached the env and ended the hand", detail)
    assert server.client_errors == 0, (dict(server.statuses), detail)
    assert trajectory.reward == 1.0, detail
    assert [r.reward for r in env.server.results] == [1.0]
    # The agent was told the hand, and offered the env's tools under the server's name.
    first_prompt = qwen3_tokenizer.decode(policy.prompts[0][1])
    assert "mcp__blackjack__stand" in first_prompt and "mcp__blackjack__hit" in first_prompt
    assert "dealer" in first_prompt.lower()
    assert len(trajectory.turns) == len(script)
    assert list(tmp_path.iterdir()) == []
