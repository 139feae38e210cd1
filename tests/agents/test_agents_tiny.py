"""Each real agent CLI against the tiny random model: whatever it writes, the agent ends cleanly.

The model behind the gateway is the offline tiny Qwen3 with a long context (agent CLIs send
first prompts of thousands to tens of thousands of tokens), served by `plies serve`. It
writes random tokens, so no agent gets a usable tool call; each must still end on its own
terms within its turn budget, and every turn it took must be on the trajectory as the
sampler produced it.

Its own terms, measured: the random model almost never samples its stop token, so most
replies are cut at `MAX_TOKENS` and the gateway says so in each dialect (`max_tokens`,
`incomplete` with `max_output_tokens`, `length`). The chat agents take a cut reply as it is
and exit 0. Claude Code asks for more a few times and then gives up with its own error
("exceeded the 32000 output token maximum", exit 1); Codex and the Agents SDK on Responses
fail the turn of an incomplete response. Those endings are asserted exactly: the agent exited
by itself, every reply it got was cut at the limit, and its own output names the limit.
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
GIVES_UP_ON_CUT_REPLIES = {
    "claude-code": "exceeded the 32000 output token maximum",
    "codex": "max_output_tokens",
    "openai-agents-responses": "max_output_tokens",
}
"""The agents that end with an error of their own when every reply is cut at the token
limit, and the words they use."""


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
    async with (
        VLLMClient(long_server.url, long_server.model) as client,
        agent_gateway(client, qwen3_tokenizer, max_tokens=MAX_TOKENS) as server,
    ):
        harness = AgentHarness(server, adapter, wall_s=240, max_turns=2)
        async with WorkspaceEnv(LocalProcessBackend(tmp_path), run_id="tiny") as env:
            trajectory = await harness.run(env, TASK)

    detail = (trajectory.error, trajectory.info.get("agent_output"), dict(server.statuses))
    said = f"{trajectory.error} {trajectory.info.get('agent_output')}"
    assert server.client_errors == 0, detail
    if trajectory.status is Status.FAILED and agent in GIVES_UP_ON_CUT_REPLIES:
        # It ended itself on replies that never end, and said why.
        assert trajectory.info["exit_code"] not in (None, 0), detail
        assert all(t.finish_reason == "length" for t in trajectory.turns), detail
        assert GIVES_UP_ON_CUT_REPLIES[agent] in said, detail
    else:
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
