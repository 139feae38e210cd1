"""Agent CLIs solve a shipped Harbor task inside its bubblewrap sandbox, through the gateway.

The agent runs where the task's tests will run: in the task's own mount and network namespace,
the workspace built from its Dockerfile at `/app`, its installation shared read-only, and one
way out, a loopback port forwarded to the gateway's Unix socket. The reward is what the task's
own `tests/test.sh` wrote after the agent exited.
"""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path

import pytest
from agent_kit import DONE, ROOT, agent_gateway, require_agent

from plies import Status
from plies.environments import Forward, HarborEnv, HarborTask, Task
from plies.harness import AgentHarness
from plies.testing import ScriptedPolicy, sandbox_processes

pytestmark = pytest.mark.anyio

FIX_MEAN = ROOT / "examples" / "harbor" / "fix-mean"
RUN_TESTS = "python3 -m unittest discover -s /app 2>&1 | tail -3"
FIX = "sed -i 's|/ (len(values) + 1)|/ len(values)|' /app/stats/core.py"
# The sandbox's network: the gateway's port answers, any other port of the host does not.
PROBE = (
    'python3 -c "import socket,sys; s=socket.socket(); '
    "sys.exit(s.connect_ex(('127.0.0.1', int(sys.argv[1]))))\" {port}; echo probe=$?"
)


def _call(name: str, **arguments: str) -> dict[str, list[dict[str, object]]]:
    return {"tool_calls": [{"name": name, "arguments": arguments}]}


def _script(agent: str, other_port: int) -> list[object]:
    commands = [RUN_TESTS, PROBE.format(port=other_port), FIX]
    if agent == "codex":
        return [*(_call("exec_command", cmd=c) for c in commands), DONE]
    return [*(_call("Bash", command=c, description="Run it") for c in commands), DONE]


@pytest.mark.parametrize("agent", ["codex", "claude-code"])
async def test_an_agent_cli_solves_a_harbor_task_in_its_sandbox(agent, qwen3_tokenizer, tmp_path):
    adapter = require_agent(agent)
    task = HarborTask.load(FIX_MEAN)
    # A port open on the host but not forwarded: the probe inside must not reach it.
    with (
        socket.create_server(("127.0.0.1", 0)) as other,
        tempfile.TemporaryDirectory(prefix="plies-gw-") as short,  # a socket path is short
    ):
        uds = Path(short) / "gateway.sock"
        policy = ScriptedPolicy(qwen3_tokenizer, _script(agent, other.getsockname()[1]))
        async with agent_gateway(policy, qwen3_tokenizer, uds=uds) as server:
            backend = task.backend(
                tmp_path,
                shares=[(ROOT / ".agents" / "npm").resolve()],
                forwards=[Forward(server.port, str(uds))],
            )
            harness = AgentHarness(server, adapter, wall_s=180, max_turns=8)
            async with HarborEnv(task, backend) as env:
                trajectory = await harness.run(env, Task(id=task.name))
            assert server.gateway.open_sessions == 0

    detail = (trajectory.error, trajectory.info.get("agent_output"), dict(server.paths))
    assert trajectory.status is Status.COMPLETED, detail
    assert server.client_errors == 0, (dict(server.statuses), detail)
    # The task's own tests paid for the fix the agent's own tool made inside the sandbox.
    assert trajectory.reward == 1.0 and trajectory.info["verified_reward"] == 1.0, detail
    outputs = "\n".join(str(m.get("content")) for m in trajectory.messages)
    assert "FAILED (failures=1)" in outputs, "the agent ran the workspace the Dockerfile built"
    assert "probe=" in outputs and "probe=0" not in outputs
    for turn, completion in zip(trajectory.turns, policy.completions, strict=True):
        assert turn.completion_ids == completion.ids
    assert [t.extends for t in trajectory.turns] == [False] + [True] * (len(trajectory.turns) - 1)
    assert list(tmp_path.iterdir()) == []
    assert sandbox_processes(tmp_path) == []
