"""Each real agent CLI against the tiny random model: whatever it writes, the agent ends cleanly.

The model behind the gateway is the offline tiny Qwen3 with a long context (agent CLIs send
first prompts of thousands to tens of thousands of tokens), served by `plies serve`. It
writes random tokens, so no agent gets a usable tool call; each must still end on its own
terms (exit 0 within its turn budget), and every turn it took must be on the trajectory as
the sampler produced it.
"""

from __future__ import annotations

import math

import pytest
from agent_kit import AGENTS, TASK, agent_gateway, require_agent

from plies import Status, testing
from plies.environments import LocalProcessBackend
from plies.harness import AgentHarness, WorkspaceEnv
from plies.policy import VLLMClient

pytestmark = pytest.mark.anyio

MAX_TOKENS = 24
"""Completion tokens per turn: the random model rarely samples its stop token."""


@pytest.fixture(scope="module")
def long_server(start_policy_server, tmp_path_factory):
    """`plies serve` on the long-context tiny model."""
    model = testing.tiny_model_dir(max_positions=testing.LONG_MAX_POSITIONS)
    state = tmp_path_factory.mktemp("long-server")
    max_len = str(testing.LONG_MAX_POSITIONS)
    with start_policy_server(model, state, "--max-model-len", max_len) as server:
        yield server


@pytest.mark.parametrize("agent", list(AGENTS))
async def test_agent_ends_cleanly_on_the_tiny_random_model(
    agent, long_server, qwen3_tokenizer, tmp_path
):
    adapter = require_agent(agent)
    if agent == "claude-code":
        # Open: on the random model's replies Claude Code 2.1.197 exits 1 after a completed
        # turn (recorded on issue 33); the scripted test of it passes.
        pytest.xfail("Claude Code exits 1 on the tiny random model's replies")
    async with (
        VLLMClient(long_server.url, long_server.model) as client,
        agent_gateway(client, qwen3_tokenizer, max_tokens=MAX_TOKENS) as server,
    ):
        harness = AgentHarness(server, adapter, wall_s=240, max_turns=2)
        async with WorkspaceEnv(LocalProcessBackend(tmp_path), run_id="tiny") as env:
            trajectory = await harness.run(env, TASK)

    detail = (trajectory.error, trajectory.info.get("agent_output"), dict(server.statuses))
    said = f"{trajectory.error} {trajectory.info.get('agent_output')}"
    if adapter.wire == "responses" and "max_output_tokens" in said:
        # Measured: Codex and the Agents SDK fail a turn whose Responses reply is incomplete
        # (cut at max_output_tokens), and the random model rarely stops within MAX_TOKENS.
        pytest.xfail("a Responses reply cut at max_output_tokens fails the agent's turn")
    assert trajectory.status is Status.COMPLETED, detail
    assert trajectory.info["exit_code"] == 0
    assert trajectory.reward == 0.0  # no file was written: the verifier pays nothing
    assert 1 <= len(trajectory.turns) <= 2 * harness.max_turns, detail
    assert len(trajectory.prompt_ids(0)) > 300  # the agent's own system prompt and tools
    for turn in trajectory.turns:
        assert 1 <= len(turn.completion_ids) <= MAX_TOKENS
        assert len(turn.logprobs) == len(turn.completion_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in turn.logprobs)
        assert turn.policy is not None and turn.policy.uri == long_server.policy["uri"]
