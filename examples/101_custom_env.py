"""Your first env: a guessing game, one group of episodes on the reference server, one GRPO step.

    python examples/101_custom_env.py

The tiny offline model is random, so it rarely calls `guess`: its episodes end cut off or
ill-formed, the harness's default `RewardPolicy` scores them (docs/environments.md), and the
group still trains. Its rewards mostly tie, so the step moves little; a real model (or the
Blackjack demo's warm start, `plies demo blackjack`) makes them differ.
"""

import random
import tempfile
from pathlib import Path
from typing import Annotated

import anyio
from pydantic import Field
from transformers import AutoTokenizer

from plies import PolicyRef
from plies.environments import Env, Observation, Task, ToolResult, tool
from plies.harness import EnvGroup, ToolCallingHarness, play_groups
from plies.policy import SamplingParams, VLLMClient
from plies.testing import plies_command, serve_process, tiny_model_dir
from plies.tokens import ChatRenderer
from plies.training import (
    AdamParams,
    TrainingClient,
    group_advantages,
    training_batch,
    training_groups,
)


class Guess(Env):
    async def setup(self, task: Task) -> Observation:
        self.secret = random.Random(task.seed).randint(1, 10)
        return Observation(messages=[{"role": "user", "content": "Guess my number, 1 to 10."}])

    @tool
    async def guess(self, n: Annotated[int, Field(ge=1, le=10)]) -> ToolResult:
        """Guess the number."""
        if n == self.secret:
            return ToolResult(content="Right!", reward=1.0, done=True)
        return ToolResult(content="Higher." if n < self.secret else "Lower.")


async def main() -> None:
    model, log = tiny_model_dir(), Path(tempfile.mkdtemp()) / "serve.log"
    async with (
        serve_process(plies_command("serve", str(model)), log=log) as server,
        VLLMClient(server.url, server.ready["model"]) as sampler,
        TrainingClient(server.url) as trainer,
    ):
        renderer = ChatRenderer(AutoTokenizer.from_pretrained(model))
        harness = ToolCallingHarness(renderer, sampler, SamplingParams(max_tokens=24))
        policy = PolicyRef.model_validate(server.ready["policy"])
        group = EnvGroup(Task(id="guess-7", seed=7), Guess, size=4)
        groups = await play_groups(harness, [group], policy=policy)
        for t in groups[0].trajectories:
            said = t.messages[-1]["content"][:40]
            print(f"{t.status} ({t.info['stop_reason']}), reward {t.reward}: {said!r}")
        selection = training_groups(groups, policy=policy, max_staleness=0)
        advantages = [group_advantages(g) for g in selection.trainable]
        print(f"trainable {len(selection.trainable)}, refused {len(selection.refused)}, "
              f"advantages {advantages}")  # fmt: skip
        batch = training_batch(selection.trainable, advantages, temperature=1.0)
        await trainer.forward_backward(batch, loss="importance_sampling")
        await trainer.optim_step(AdamParams(lr=1e-3))
        print(f"trained one step: policy version {(await trainer.save_policy()).version}")


if __name__ == "__main__":
    anyio.run(main)
