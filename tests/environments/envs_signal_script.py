"""A rollout script for the Ctrl-C tests of MCP and Harbor episodes, under `plies.runtime.run`.

    python envs_signal_script.py mcp|harbor RUN_DIR [NPM_BIN]

Four episodes at once through `ToolCallingHarness` with a scripted policy: MCP episodes call
server-memory (a process each) turn after turn; Harbor episodes run a long `bash` command in
their bubblewrap sandbox. Events go to stdout as JSON lines: ready, turn (each sample),
group, stats.
"""

from __future__ import annotations

import sys
from contextlib import AsyncExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))  # event_script

import anyio
from event_script import drive_harness, emit
from scripted_policy import POLICY, ScriptedPolicy
from transformers import AutoTokenizer

from plies.environments import HarborEnv, HarborTask, McpEnv, McpHost, McpServer, Task
from plies.harness import EpisodeLimits, ToolCallingHarness
from plies.policy import SamplingParams
from plies.runtime import EnvPool, GroupSpec, RolloutDriver, run
from plies.testing import qwen3_tokenizer_dir
from plies.tokens import ChatRenderer

TASKS = Path(__file__).parents[2] / "examples" / "harbor"


async def main(interrupts, kind: str, run_dir: Path, npm_bin: Path | None) -> None:
    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())

    async def script(session: str, turn: int, prompt: str):
        emit("turn", session=session, turn=turn)
        await anyio.sleep(0.2)
        if kind == "mcp":
            return [("read_graph", {})]
        return [("bash", {"command": "sleep 60"})] if turn == 0 else [("submit", {})]

    harness = ToolCallingHarness(
        ChatRenderer(tokenizer),
        ScriptedPolicy(tokenizer, script),
        SamplingParams(max_tokens=64),
        limits=EpisodeLimits(max_turns=200),
    )
    async with AsyncExitStack() as stack:
        if kind == "mcp":
            server = McpServer.stdio(
                [str(npm_bin / "mcp-server-memory")],
                env={"MEMORY_FILE_PATH": "{episode_dir}/memory.jsonl"},
            )
            host = await stack.enter_async_context(McpHost(server))

            async def make() -> McpEnv:
                return host.env()

            task = Task(id="mcp", data={"prompt": "Read the graph."})
        else:
            harbor = HarborTask.load(TASKS / "count-lines")

            async def make() -> HarborEnv:
                return HarborEnv(harbor, harbor.backend(run_dir / "sandboxes"))

            task = Task(id="harbor")
        pool = EnvPool(make, settle_timeout=0.5, teardown_timeout=5, teardown_retries=2)

        async def admit_two(driver: RolloutDriver) -> None:
            for i in range(2):
                await driver.admit(GroupSpec(f"{kind}-{i}", size=2, task=task))
            driver.close_admission()

        await drive_harness(harness, [pool], run_dir, interrupts, admit_two, policy=POLICY)


if __name__ == "__main__":
    kind, run_dir = sys.argv[1], Path(sys.argv[2])
    npm_bin = Path(sys.argv[3]) if len(sys.argv) > 3 else None
    raise SystemExit(run(lambda interrupts: main(interrupts, kind, run_dir, npm_bin)))
