"""Each real agent CLI finishes the three-step task through the gateway, driven by a script.

The scripted policy answers each turn with a tool call (or the final text) written in Qwen3's
own format through the real tokenizer; the gateway renders, parses and records for real, and
the agent runs its own tools in its own workspace. The reward comes from the env's verifier
after the agent exited.
"""

from __future__ import annotations

import pytest
from agent_kit import AGENTS, SCRIPTS, TASK, agent_gateway, require_agent

from plies import Status
from plies.environments import LocalProcessBackend
from plies.harness import AgentHarness, WorkspaceEnv
from plies.testing import ScriptedPolicy

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("agent", list(AGENTS))
async def test_agent_finishes_the_three_step_task(agent, qwen3_tokenizer, tmp_path):
    adapter = require_agent(agent)
    policy = ScriptedPolicy(qwen3_tokenizer, SCRIPTS[agent])
    async with agent_gateway(policy, qwen3_tokenizer) as server:
        harness = AgentHarness(server, adapter, wall_s=180, max_turns=8)
        async with WorkspaceEnv(LocalProcessBackend(tmp_path), run_id="agents") as env:
            trajectory = await harness.run(env, TASK, group_id="g")
        assert server.gateway.open_sessions == 0
    assert list(tmp_path.iterdir()) == []  # the workspace went with the env

    detail = (trajectory.error, trajectory.info.get("agent_output"), dict(server.paths))
    assert trajectory.status is Status.COMPLETED, detail
    assert trajectory.info["exit_code"] == 0
    assert server.client_errors == 0, (dict(server.statuses), detail)
    # The verifier found the file the agent's own tool wrote.
    assert trajectory.reward == 1.0 and trajectory.info["verified_reward"] == 1.0
    # Every answer the policy gave was delivered and recorded, exactly as sampled.
    script = SCRIPTS[agent]
    assert len(policy.completions) == len(script) == len(trajectory.turns)
    for turn, completion in zip(trajectory.turns, policy.completions, strict=True):
        assert turn.completion_ids == completion.ids
        assert turn.logprobs == completion.logprobs
    for k, (_, prompt) in enumerate(policy.prompts):
        assert trajectory.prompt_ids(k) == prompt
    # Each turn after the first extended the tokens the gateway already held.
    assert [t.extends for t in trajectory.turns] == [False] + [True] * (len(script) - 1), (
        trajectory.info["fallbacks"]
    )
    assert trajectory.info["agent"] == adapter.name
