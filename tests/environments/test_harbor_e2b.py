"""Harbor tasks on E2B: the same tasks, their paths real directories of the sandbox.

E2B's cloud cannot be reached from here, so the sandboxes are `_e2b_fake`'s stand-in for
`e2b.AsyncSandbox` (the SDK's signatures and errors), with `isolated=True`: each sandbox's
directory is its root filesystem, so the task's `/app`, `/tests` and `/logs` are the
sandbox's own and a bad path cannot touch the host. The rewards are what each task's own
`tests/test.sh` wrote, read back through the files API.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _e2b_fake import FakeE2BCloud
from test_harbor import play

from plies import Status
from plies.environments import HarborEnv, HarborTask, Task

pytestmark = pytest.mark.anyio

TASKS = Path(__file__).parents[2] / "examples" / "harbor"
FIX = "sed -i 's|/ (len(values) + 1)|/ len(values)|' /app/stats/core.py"


@pytest.fixture
def cloud(tmp_path) -> FakeE2BCloud:
    root = tmp_path / "e2b"
    root.mkdir()
    return FakeE2BCloud(root, isolated=True)


async def test_a_task_is_solved_on_e2b_with_reward_one_from_its_own_tests(qwen3_tokenizer, cloud):
    task = HarborTask.load(TASKS / "fix-mean")
    backend = task.e2b_backend(sandbox_cls=cloud.sandbox_class)

    async def script(session: str, turn: int, prompt: str):
        steps = [
            [("bash", {"command": "pwd; python3 -m unittest discover -s /app 2>&1 | tail -3"})],
            [("bash", {"command": FIX})],
        ]
        return steps[turn] if turn < len(steps) else [("submit", {})]

    trajectories, _ = await play(qwen3_tokenizer, script, task, None, n=2, backend=backend)
    for traj in trajectories:
        assert traj.status is Status.COMPLETED, (traj.error, traj.info)
        assert traj.reward == 1.0 and traj.info["env"]["rewards"] == {"reward": 1.0}
        first = next(m["content"] for m in traj.messages if m["role"] == "tool")
        assert first.splitlines()[1] == "/app" and "FAILED (failures=1)" in first
    assert cloud.creates == 2 and cloud.sandboxes == {}  # both killed
    assert not Path("/app/stats").exists(), "the task's paths stayed in the sandbox"


async def test_the_oracle_solves_a_task_built_by_run_steps_on_e2b(cloud):
    task = HarborTask.load(TASKS / "count-lines")
    async with HarborEnv(task, task.e2b_backend(sandbox_cls=cloud.sandbox_class)) as env:
        await env.reset(Task(id=task.name))
        (record,) = cloud.sandboxes.values()
        result = await env.oracle()
        assert (record.root / "tests" / "test.sh").is_file()
    assert result.reward == 1.0, result
    assert result.info["solve_exit_code"] == 0
    assert cloud.sandboxes == {}


async def test_without_a_solution_the_tests_pay_nothing_on_e2b(cloud):
    task = HarborTask.load(TASKS / "fix-mean")
    async with HarborEnv(task, task.e2b_backend(sandbox_cls=cloud.sandbox_class)) as env:
        await env.reset(Task(id=task.name))
        # The agent forges a reward before the tests run: they empty /logs/verifier first.
        await env.call_tool("bash", {"command": "echo 1 > /logs/verifier/reward.txt"})
        result = await env.call_tool("submit", {})
    assert result.reward == 0.0 and result.done


@pytest.mark.skipif(not os.environ.get("E2B_API_KEY"), reason="needs E2B_API_KEY and E2B's cloud")
async def test_live_e2b_runs_the_oracle_of_a_shipped_task():
    task = HarborTask.load(TASKS / "fix-mean")
    backend = task.e2b_backend(sandbox_timeout_s=300)
    async with HarborEnv(task, backend, run_id="live-harbor") as env:
        await env.reset(Task(id=task.name))
        result = await env.oracle()
    assert result.reward == 1.0 and result.info["solve_exit_code"] == 0, result
