"""Codex finishes its task through an engine that takes 6 minutes over one answer.

Codex gives up on a stream that is silent for 300 s (its default `stream_idle_timeout_ms`).
The gateway samples a turn whole, so while a slow engine samples it sends
`response.in_progress` every `keepalive_s` (5 s) on the open stream; Codex then waits as long
as the engine takes. Here the policy sits on Codex's first request for `DELAY_S`, past that
timeout, and Codex must still finish the three-step task.

This test waits more than 6 minutes doing nothing, so `.ci/agents-tier` runs it beside the
other agent tests rather than after them, and the main test run skips it.
"""

from __future__ import annotations

import os
import time
from typing import Any

import anyio
import pytest
from agent_kit import SCRIPTS, TASK, agent_gateway, require_agent

from plies import Status
from plies.environments import LocalProcessBackend
from plies.harness import AgentHarness, WorkspaceEnv
from plies.policy import Completion
from plies.testing import ScriptedPolicy

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(
        not os.environ.get("PLIES_SLOW_AGENT_TESTS"),
        reason="waits 6 minutes; .ci/agents-tier runs it (PLIES_SLOW_AGENT_TESTS=1)",
    ),
]

DELAY_S = 370.0
"""Past Codex's 300 s stream idle timeout, and past 6 minutes."""


class SlowFirstAnswer(ScriptedPolicy):
    """The scripted policy, silent for `DELAY_S` before its first answer."""

    async def sample(self, *args: Any, **kwargs: Any) -> Completion:
        if not self.prompts:
            await anyio.sleep(DELAY_S)
        return await super().sample(*args, **kwargs)


@pytest.mark.timeout(DELAY_S + 300)
async def test_codex_waits_out_a_six_minute_answer(qwen3_tokenizer, tmp_path):
    adapter = require_agent("codex")
    policy = SlowFirstAnswer(qwen3_tokenizer, SCRIPTS["codex"])
    started = time.monotonic()
    async with agent_gateway(policy, qwen3_tokenizer) as server:
        harness = AgentHarness(server, adapter, wall_s=DELAY_S + 180, max_turns=8)
        async with WorkspaceEnv(LocalProcessBackend(tmp_path), run_id="slow") as env:
            trajectory = await harness.run(env, TASK)
    took = time.monotonic() - started

    detail = (trajectory.error, trajectory.info.get("agent_output"), dict(server.statuses))
    assert took > DELAY_S
    assert trajectory.status is Status.COMPLETED, detail
    assert server.client_errors == 0, detail
    assert trajectory.reward == 1.0
    # One request per answer: Codex did not give up on the slow stream and ask again.
    assert server.paths["POST /v1/responses"] == len(SCRIPTS["codex"]), dict(server.paths)
    assert len(trajectory.turns) == len(SCRIPTS["codex"])
