"""`AgentHarness` and `WorkspaceEnv` with a small real agent program, in the main test run.

The agent (`chat_agent.py`) is a real program on the official openai client, started by an
adapter written here the way a user would write one for their own agent; the gateway and the
sandbox are real, the policy is scripted. The six packaged agents run in tests/agents.
"""

from __future__ import annotations

import json
import os
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import anyio
import pytest

from plies import ConfigError, Status
from plies.environments import BlackjackEnv, LocalProcessBackend, Task
from plies.gateway import Gateway, GatewayServer
from plies.harness import (
    AgentHarness,
    AgentLaunch,
    AgentsSdk,
    Codex,
    EnvGroup,
    Harness,
    LaunchSpec,
    OpenCode,
    ToolCallingHarness,
    WorkspaceEnv,
    play_groups,
)
from plies.policy import SamplingParams
from plies.testing import ScriptedPolicy
from plies.testing._scripted import SCRIPTED_POLICY
from plies.tokens import ChatRenderer

pytestmark = pytest.mark.anyio

AGENT = Path(__file__).with_name("chat_agent.py")
TASK = Task(
    id="hello",
    data={
        "instruction": "Write hello.txt containing hello.",
        "files": {"notes/readme.txt": "the task's own file"},
        "verify": ["grep", "-qx", "hello", "hello.txt"],
    },
)


@dataclass(frozen=True)
class ChatAgent:
    """An adapter for `chat_agent.py`, or for any command given as `argv`."""

    argv: tuple[str, ...] = ()
    name: ClassVar[str] = "chat-agent"
    package: ClassVar[str] = "tests"
    version: ClassVar[str] = "0"
    wire: ClassVar[str] = "chat"

    def launch(self, spec: LaunchSpec) -> AgentLaunch:
        argv = list(self.argv) or [sys.executable, str(AGENT), spec.instruction]
        env = {
            "HOME": spec.home,
            "OPENAI_BASE_URL": spec.base_url + "/v1",
            "OPENAI_API_KEY": spec.api_key,
        }
        return AgentLaunch(argv, env, {"settings/marker.txt": "configured"})


def sh(command: str) -> dict:
    return {"tool_calls": [{"name": "sh", "arguments": {"command": command}}]}


def _gateway(tokenizer, script) -> Gateway:
    """A gateway over a scripted policy (`gateway.sampler`)."""
    renderer = ChatRenderer(tokenizer, template="model")
    sampling = SamplingParams(max_tokens=256)
    policy = ScriptedPolicy(tokenizer, script)
    return Gateway(policy, renderer, sampling=sampling, settle_timeout=5.0)


def _in_sandboxes(root: Path) -> list[int]:
    """Live processes carrying a sandbox id under `root`: the agent and all it started."""
    prefix = f"PLIES_SANDBOX_ID={root}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(v.startswith(prefix) for v in environ):
            found.append(int(entry.name))
    return found


async def test_agent_works_in_its_workspace_and_the_verifier_pays(qwen3_tokenizer, tmp_path):
    script = [sh('cat notes/readme.txt "$HOME/settings/marker.txt"; echo hello > hello.txt'), "ok"]
    gateway = _gateway(qwen3_tokenizer, script)
    async with gateway, GatewayServer(gateway) as server:
        harness = AgentHarness(server, ChatAgent(), wall_s=60)
        async with WorkspaceEnv(LocalProcessBackend(tmp_path), run_id="t") as env:
            trajectory = await harness.run(env, TASK, group_id="g")
        assert gateway.open_sessions == 0
    assert list(tmp_path.iterdir()) == []
    assert trajectory.status is Status.COMPLETED, trajectory.error
    assert trajectory.reward == 1.0 and trajectory.group_id == "g"
    assert trajectory.info["agent"] == "chat-agent" and trajectory.info["exit_code"] == 0
    assert trajectory.info["agent_output"].strip() == "ok"
    # The task's file and the adapter's config file were there for the agent's tool.
    tool_output = trajectory.messages[2]["content"]
    assert tool_output == "the task's own fileconfigured"
    completions = gateway.sampler.completions
    assert [t.completion_ids for t in trajectory.turns] == [c.ids for c in completions]
    assert [t.extends for t in trajectory.turns] == [False, True]


async def test_past_wall_s_the_agent_is_killed_and_the_workspace_still_scored(
    qwen3_tokenizer, tmp_path
):
    gateway = _gateway(qwen3_tokenizer, [sh("echo hello > hello.txt; sleep 120")])
    async with gateway, GatewayServer(gateway) as server:
        harness = AgentHarness(server, ChatAgent(), wall_s=3)
        async with WorkspaceEnv(LocalProcessBackend(tmp_path), run_id="t") as env:
            trajectory = await harness.run(env, TASK)
            assert _in_sandboxes(tmp_path) == []  # its process group went at the cut
    assert trajectory.status is Status.TRUNCATED
    assert "wall_s=3" in trajectory.error
    assert trajectory.reward == 1.0  # the file was written: truncation keeps what was paid
    assert len(trajectory.turns) == 1


async def test_an_agent_that_fails_fails_the_episode_without_a_reward(qwen3_tokenizer, tmp_path):
    crash = (sys.executable, "-c", "import sys; print('no model', file=sys.stderr); sys.exit(3)")
    gateway = _gateway(qwen3_tokenizer, ["unused"])
    async with gateway, GatewayServer(gateway) as server:
        harness = AgentHarness(server, ChatAgent(crash), wall_s=30)
        async with WorkspaceEnv(LocalProcessBackend(tmp_path), run_id="t") as env:
            trajectory = await harness.run(env, TASK)
        assert gateway.open_sessions == 0
    assert trajectory.status is Status.FAILED and trajectory.reward is None
    assert "exited with 3" in trajectory.error and "no model" in trajectory.error
    assert trajectory.turns == []


async def test_a_cancelled_episode_kills_the_agent_and_drops_its_session(qwen3_tokenizer, tmp_path):
    gateway = _gateway(qwen3_tokenizer, [sh("sleep 120")])
    async with gateway, GatewayServer(gateway) as server:
        harness = AgentHarness(server, ChatAgent(), wall_s=60)
        async with WorkspaceEnv(LocalProcessBackend(tmp_path), run_id="t") as env:
            with anyio.move_on_after(30) as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(harness.run, env, TASK)
                    while not any(_sleeping(pid) for pid in _in_sandboxes(tmp_path)):
                        await anyio.sleep(0.1)
                    tg.cancel_scope.cancel()
            assert not scope.cancelled_caught, "the agent never reached its sleep"
            assert _in_sandboxes(tmp_path) == []
        assert gateway.open_sessions == 0
    assert list(tmp_path.iterdir()) == []


def _sleeping(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sleep\0")
    except OSError:
        return False


async def test_play_groups_takes_an_agent_harness(qwen3_tokenizer, tmp_path):
    """Any `Harness` feeds `play_groups`: here two agent episodes of one group."""
    gateway = _gateway(qwen3_tokenizer, [sh("echo hello > hello.txt"), "ok"])
    async with gateway, GatewayServer(gateway) as server:
        harness = AgentHarness(server, ChatAgent(), wall_s=60)
        assert isinstance(harness, Harness) and harness.sampler is gateway.sampler

        async def make_env() -> WorkspaceEnv:
            return WorkspaceEnv(LocalProcessBackend(tmp_path), run_id="t")

        [group] = await play_groups(
            harness, [EnvGroup(TASK, make_env, size=2)], policy=SCRIPTED_POLICY
        )
    assert [t.status for t in group.trajectories] == [Status.COMPLETED] * 2
    assert [t.reward for t in group.trajectories] == [1.0, 1.0]
    assert all(len(t.turns) == 2 for t in group.trajectories)
    assert list(tmp_path.iterdir()) == []


def test_every_harness_implements_the_protocol(qwen3_tokenizer):
    renderer = ChatRenderer(qwen3_tokenizer)
    built_in = ToolCallingHarness(
        renderer, ScriptedPolicy(qwen3_tokenizer, []), SamplingParams(max_tokens=8)
    )
    assert isinstance(built_in, Harness)
    assert not isinstance(object(), Harness)


async def test_misuse_is_a_clear_error(qwen3_tokenizer, tmp_path):
    gateway = _gateway(qwen3_tokenizer, [])
    async with gateway, GatewayServer(gateway) as server:
        with pytest.raises(ConfigError, match="AgentAdapter"):
            AgentHarness(server, object())  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="wall_s"):
            AgentHarness(server, ChatAgent(), wall_s=0)
        harness = AgentHarness(server, ChatAgent())
        with pytest.raises(ConfigError, match="WorkspaceEnv"):
            await harness.run(BlackjackEnv(), TASK)
        async with WorkspaceEnv(LocalProcessBackend(tmp_path), run_id="t") as env:
            with pytest.raises(ConfigError, match="instruction"):
                await harness.run(env, Task(id="empty"))
        assert gateway.open_sessions == 0
    with pytest.raises(ConfigError, match="chat' or 'responses"):
        AgentsSdk(wire="messages")


SPEC = LaunchSpec(
    instruction="do it",
    base_url="http://127.0.0.1:9",
    api_key="plies-sk-test",
    model="plies-policy",
    home="/w/.plies-agent",
    workdir="/w",
    max_turns=5,
)


def test_codex_is_pointed_at_the_gateway_on_the_responses_wire():
    launch = Codex(command="codex").launch(SPEC)
    config = tomllib.loads(launch.files[".codex/config.toml"])
    provider = config["model_providers"][config["model_provider"]]
    assert provider["base_url"] == "http://127.0.0.1:9/v1"
    assert provider["wire_api"] == "responses"
    assert launch.env[provider["env_key"]] == "plies-sk-test"
    assert launch.env["CODEX_HOME"] == "/w/.plies-agent/.codex"
    assert config["features"] == {"plugins": False, "remote_plugin": False}


def test_opencode_names_the_gateway_as_its_only_model():
    launch = OpenCode(command="opencode").launch(SPEC)
    config = json.loads(launch.files[".config/opencode/opencode.json"])
    provider = config["provider"]["plies"]
    assert provider["options"]["baseURL"] == "http://127.0.0.1:9/v1"
    assert config["model"] == config["small_model"] == "plies/plies-policy"
    key_var = provider["options"]["apiKey"].removeprefix("{env:").removesuffix("}")
    assert launch.env[key_var] == "plies-sk-test"
    assert launch.env["XDG_CONFIG_HOME"] == "/w/.plies-agent/.config"
