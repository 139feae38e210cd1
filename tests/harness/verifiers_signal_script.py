"""A rollout script for the Ctrl-C test of verifiers episodes, under `plies.runtime.run`.

    PLIES_VERIFIERS_PYTHON=... python verifiers_signal_script.py RUN_DIR

Four rollouts of `verifiers_envs/adder.py` at once through `VerifiersHarness`, on a scripted
policy behind a gateway; each calls the env's tool, which sleeps for a minute. Events go to
stdout as JSON lines: ready (with the sidecar's pid), turn (each sample), group, stats.
verifiers' cleanup handler writes each rollout's id to RUN_DIR/cleanups.log.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))  # event_script

from event_script import drive_harness, emit
from transformers import AutoTokenizer

from plies.gateway import Gateway, GatewayServer
from plies.harness import VerifiersHarness
from plies.policy import SamplingParams
from plies.runtime import RolloutDriver, run
from plies.testing import ScriptedPolicy, qwen3_tokenizer_dir
from plies.testing._scripted import SCRIPTED_POLICY
from plies.tokens import ChatRenderer

ADDER = Path(__file__).parent / "verifiers_envs" / "adder.py"


def ask_add(prompt: str) -> dict:
    emit("turn")
    a, b = re.findall(r"What is (\d+) \+ (\d+)\?", prompt)[-1]
    return {"tool_calls": [{"name": "add", "arguments": {"a": int(a), "b": int(b)}}]}


async def main(interrupts, run_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    policy = ScriptedPolicy(tokenizer, [ask_add, "The sum is 0"])
    renderer = ChatRenderer(tokenizer, template="model")
    args = {"cleanup_log": str(run_dir / "cleanups.log"), "tool_delay_s": 60.0}
    async with (
        Gateway(policy, renderer, sampling=SamplingParams(max_tokens=128)) as gateway,
        GatewayServer(gateway) as server,
        VerifiersHarness(
            server, ADDER, python=os.environ["PLIES_VERIFIERS_PYTHON"], env_args=args
        ) as harness,
    ):
        rows = await harness.dataset()

        async def admit_two(driver: RolloutDriver) -> None:
            for spec in harness.groups(rows[:2], size=2):
                await driver.admit(spec)
            driver.close_admission()

        await drive_harness(
            harness,
            [harness.pool()],
            run_dir,
            interrupts,
            admit_two,
            policy=SCRIPTED_POLICY,
            ready={"sidecar": harness._process.pid},
            more_stats=lambda: {"sessions": gateway.open_sessions},
        )


if __name__ == "__main__":
    run_dir = Path(sys.argv[1])
    raise SystemExit(run(lambda interrupts: main(interrupts, run_dir)))
