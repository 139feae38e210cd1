"""A run that plays agent episodes under plies' Ctrl-C handling; the interrupt test signals it.

    python interrupt_script.py RUN_DIR WORLD AGENT [AGENT ...]

One group of two episodes per agent, all in one driver, each episode an agent CLI whose first
tool call is a long `sleep` in its sandbox (under RUN_DIR/sandboxes), through a gateway of its
own with a scripted policy. WORLD is the env it plays: `workspace` (a `WorkspaceEnv`),
`harbor` (the `count-lines` Harbor task, the agent inside its bubblewrap sandbox reaching the
gateway through a forwarded port) or `mcp` (a `BlackjackEnv` served to the agent over MCP by
an `McpWorkspaceEnv`). Prints one JSON line `{"event": "ready"}` once
every group is admitted; groups go to RUN_DIR/groups.jsonl, the quarantine report to
RUN_DIR/quarantine.json.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

from agent_kit import AGENTS, ROOT, agent_gateway
from transformers import AutoTokenizer

from plies import testing
from plies.environments import (
    BlackjackEnv,
    Forward,
    HarborEnv,
    HarborTask,
    LocalProcessBackend,
    Task,
)
from plies.harness import AgentHarness, McpWorkspaceEnv, MiniSweAgent, WorkspaceEnv
from plies.runtime import EnvPool, GroupSpec, JsonlSink, RolloutDriver, RolloutResources, run
from plies.testing._scripted import SCRIPTED_POLICY, ScriptAnswer

HARBOR_TASK = ROOT / "examples" / "harbor" / "count-lines"

SLEEP = "sleep 300"
SLEEPS = {
    "mini-swe-agent": ("bash", {"command": SLEEP}),
    "openai-agents-chat": ("run_command", {"command": SLEEP}),
    "openai-agents-responses": ("run_command", {"command": SLEEP}),
    "opencode": ("bash", {"command": SLEEP, "description": "Wait"}),
    "pi": ("bash", {"command": SLEEP}),
    "claude-code": ("Bash", {"command": SLEEP, "description": "Wait"}),
    "codex": ("exec_command", {"cmd": SLEEP}),
}
TASK = Task(id="wait", data={"instruction": "Wait five minutes, then say done."})
TURNS = 64
"""Answers per episode, enough to keep every agent in a sleep until the test's Ctrl-C: some
agents give a command a limited time (Codex yields after 10 s, the Agents SDK script's tool
times out at 60 s) and then ask the model again, which asks for the sleep again."""


def keep_sleeping(name: str, arguments: dict[str, str]) -> Callable[[str], ScriptAnswer]:
    """Answer every turn that offers tool `name` with the sleep.

    A side request some agents send on the same session (a title, a summary) offers no tools
    and is answered in words. The answer depends on the prompt, not on its position, because
    the gateway serves an agent's concurrent requests in any order.
    """
    call = {"tool_calls": [{"name": name, "arguments": arguments}]}

    def answer(prompt: str) -> ScriptAnswer:
        return call if f'"name": "{name}"' in prompt else "Done."

    return answer


def env_maker(world: str, sandboxes: Path, port: int, uds: Path) -> Callable[[], Awaitable[Any]]:
    """Makes one agent's envs in `world`; `port` and `uds` are its gateway's."""
    if world == "harbor":
        task = HarborTask.load(HARBOR_TASK)
        shares = [(ROOT / ".agents" / "npm").resolve()]
        backend = task.backend(sandboxes, shares=shares, forwards=[Forward(port, str(uds))])

        async def harbor() -> HarborEnv:
            return HarborEnv(task, backend, run_id="interrupt")

        return harbor
    local = LocalProcessBackend(sandboxes)

    async def workspace() -> WorkspaceEnv:
        if world == "mcp":
            return McpWorkspaceEnv(BlackjackEnv(), local, run_id="interrupt")
        return WorkspaceEnv(local, run_id="interrupt")

    return workspace


async def main(interrupts, run_dir: Path, world: str, agents: list[str]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(testing.qwen3_tokenizer_dir())
    sockets = Path(tempfile.mkdtemp(prefix="plies-int-"))  # a socket path must be short
    harnesses: dict[str, AgentHarness] = {}
    pools = []
    async with AsyncExitStack() as stack:
        for agent in agents:
            policy = testing.ScriptedPolicy(tokenizer, [keep_sleeping(*SLEEPS[agent])] * TURNS)
            adapter = AGENTS[agent]()
            if isinstance(adapter, MiniSweAgent):  # its shell cuts commands at 30 s
                adapter = replace(adapter, config=("environment.timeout=600",))
            uds = sockets / f"{agent}.sock"
            server = await stack.enter_async_context(agent_gateway(policy, tokenizer, uds=uds))
            harnesses[agent] = AgentHarness(server, adapter, wall_s=600, max_turns=TURNS)
            make = env_maker(world, run_dir / "sandboxes", server.port, uds)
            pools.append(EnvPool(make, limit=2, name=agent))

        async def episode(ctx):
            agent = ctx.task.data["agent"]
            return await harnesses[agent].play(ctx, pool=agent)

        async with (
            RolloutResources(pools=pools, report_path=run_dir / "quarantine.json") as resources,
            RolloutDriver(
                resources, episode, policy=SCRIPTED_POLICY, max_groups_in_flight=None
            ) as driver,
        ):
            sink = JsonlSink(run_dir / "groups.jsonl").open()
            interrupts.attach(driver)
            for agent in agents:
                task = Task(id=f"wait-{agent}", seed=1, data={**TASK.data, "agent": agent})
                driver.admit_nowait(GroupSpec(task_id=task.id, size=2, task=task))
            driver.close_admission()
            print(json.dumps({"event": "ready"}), flush=True)
            try:
                async for group in driver.groups():
                    sink.write_group(group)
                    statuses = [t.status for t in group.trajectories]
                    print(json.dumps({"event": "group", "statuses": statuses}), flush=True)
            finally:
                sink.close()


if __name__ == "__main__":
    directory, world, which = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    raise SystemExit(run(lambda interrupts: main(interrupts, directory, world, which)))
