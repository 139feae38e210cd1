"""A run that plays agent episodes under plies' Ctrl-C handling; the interrupt test signals it.

    python interrupt_script.py RUN_DIR AGENT

Two episodes of one group, each an agent CLI whose first tool call is a long `sleep` in its
workspace (sandboxes under RUN_DIR/sandboxes), through a gateway with a scripted policy.
Prints one JSON line `{"event": "ready"}` once the gateway is up; groups go to
RUN_DIR/groups.jsonl, the quarantine report to RUN_DIR/quarantine.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conftest import AGENTS, agent_gateway
from transformers import AutoTokenizer

from plies import testing
from plies.environments import LocalProcessBackend, Task
from plies.harness import AgentHarness, WorkspaceEnv
from plies.runtime import EnvPool, GroupSpec, JsonlSink, RolloutDriver, RolloutResources, run

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


async def main(interrupts, run_dir: Path, agent: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(testing.qwen3_tokenizer_dir())
    name, arguments = SLEEPS[agent]
    script = [{"tool_calls": [{"name": name, "arguments": arguments}]}, "Done."]
    policy = testing.ScriptedPolicy(tokenizer, script)
    adapter = AGENTS[agent]()
    backend = LocalProcessBackend(run_dir / "sandboxes")
    async with agent_gateway(policy, tokenizer, wire=adapter.wire) as server:
        harness = AgentHarness(server, adapter, wall_s=600, max_turns=4)

        async def make_env() -> WorkspaceEnv:
            return WorkspaceEnv(backend, run_id="interrupt")

        pool = EnvPool(make_env, limit=2)
        async with (
            RolloutResources(
                policy=harness.policy, pools=[pool], report_path=run_dir / "quarantine.json"
            ) as resources,
            RolloutDriver(resources, harness.play, policy=testing.SCRIPTED_POLICY) as driver,
        ):
            sink = JsonlSink(run_dir / "groups.jsonl").open()
            interrupts.attach(driver)
            driver.admit_nowait(GroupSpec(task_id=TASK.id, size=2, task=TASK))
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
    directory, which = Path(sys.argv[1]), sys.argv[2]
    raise SystemExit(run(lambda interrupts: main(interrupts, directory, which)))
