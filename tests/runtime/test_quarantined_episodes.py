"""An episode whose lease was quarantined is never trainable, even when it returned a record.

The harness catches a wall-clock cut and returns `truncated`; the tool call it abandoned did
not settle, so the driver must override that status with `quarantined`.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest

from plies import PolicyRef, Status
from plies.environments import BlackjackEnv, Task, ToolResult, tool
from plies.harness import EpisodeLimits, ToolCallingHarness
from plies.policy import Completion, SamplingParams
from plies.runtime import EnvPool, GroupSpec, RolloutDriver, RolloutResources
from plies.tokens import ChatRenderer
from plies.training import training_groups

pytestmark = pytest.mark.anyio

POLICY = PolicyRef(uri="plies://test/policies/0", version=0)
TOOL_CALL = '<tool_call>\n{"name": "hit", "arguments": {}}\n</tool_call><|im_end|>'


class ScriptedClient:
    """Answers every prompt with a call of the `hit` tool."""

    def __init__(self, tokenizer):
        self.ids = tokenizer.encode(TOOL_CALL, add_special_tokens=False)

    async def sample(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, policy=None, session=None
    ) -> Completion:
        return Completion(
            ids=self.ids, logprobs=[-0.5] * len(self.ids), finish_reason="stop", policy=POLICY
        )


class Hanging(BlackjackEnv):
    """A remote env whose move never answers."""

    @tool
    async def hit(self) -> ToolResult:
        """Take another card."""
        await anyio.sleep(60)
        return ToolResult(content="late")


async def test_a_wall_clock_cut_that_leaves_a_tool_call_unsettled_is_quarantined(
    qwen3_tokenizer,
):
    harness = ToolCallingHarness(
        ChatRenderer(qwen3_tokenizer),
        ScriptedClient(qwen3_tokenizer),
        SamplingParams(max_tokens=32, temperature=0.0),
        limits=EpisodeLimits(wall_s=0.3),
    )

    async def make() -> Hanging:
        return Hanging()

    client = ScriptedClient(qwen3_tokenizer)
    pool = EnvPool(make, settle_timeout=0.1, teardown_retries=0)
    async with RolloutResources(sampler=client, pools=[pool]) as resources:
        async with RolloutDriver(resources, harness.play, policy=POLICY) as driver:
            await driver.admit(GroupSpec(task_id="hang", task=Task(id="hang", seed=1)))
            driver.close_admission()
            with anyio.fail_after(20):
                [group] = [g async for g in driver.groups()]
        stats = resources.statistics()

    [traj] = group.trajectories
    assert traj.info["stop_reason"] == "wall_clock" and len(traj.turns) == 1
    assert traj.status is Status.QUARANTINED
    [entry] = traj.info["quarantined_leases"]
    assert "tool:hit" in entry["reason"] and "did not settle" in entry["reason"]
    assert stats.quarantined == 1
    selection = training_groups([group], policy=POLICY, max_staleness=0)
    assert selection.trainable == [] and len(selection.refused) == 1
