"""Your first env, trained: a guessing game, GRPO on the reference server with `plies.rl.train`.

    python examples/101_custom_env.py [RUN_DIR]

Run it again with the same RUN_DIR after Ctrl-C and it resumes. The tiny offline model is
random, so it rarely calls `guess`: its episodes end cut off, the harness's `RewardPolicy`
scores them alike (docs/environments.md), and groups whose members all scored alike teach
nothing, so the loop sets them aside and stops once a few batches' worth in a row did. A
model that calls the tool (or the Blackjack demo's warm start) gives groups that train.
"""

import random
import sys
from pathlib import Path
from typing import Annotated

from pydantic import Field
from transformers import AutoTokenizer

from plies import PolicyRef, rl
from plies.environments import Env, Observation, Task, ToolResult, tool
from plies.harness import ToolCallingHarness
from plies.policy import SamplingParams, VLLMClient
from plies.runtime import Interrupts, run
from plies.testing import plies_command, serve_process, tiny_model_dir
from plies.tokens import ChatRenderer
from plies.training import TrainingClient


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


async def main(out: Path, interrupts: Interrupts) -> None:
    model = tiny_model_dir()
    out.mkdir(parents=True, exist_ok=True)
    serve = plies_command("serve", str(model), "--state-dir", str(out / "server"))
    async with (
        serve_process(serve, log=out / "server.log") as server,
        VLLMClient(server.url, server.ready["model"]) as sampler,
        TrainingClient(server.url) as trainer,
    ):
        renderer = ChatRenderer(AutoTokenizer.from_pretrained(model))
        harness = ToolCallingHarness(renderer, sampler, SamplingParams(max_tokens=24))
        policy = await rl.train(
            out / "grpo",
            rl.GRPOConfig(steps=4, group_size=4, groups_per_step=2, max_idle_batches=2),
            tasks=lambda i: Task(id=f"guess-{i}", seed=i),
            env=Guess,
            play=harness.play,
            trainer=trainer,
            sampler=sampler,
            policy=PolicyRef.model_validate(server.ready["policy"]),
            interrupts=interrupts,
            held_out=[Task(id=f"held-out-{i}", seed=10_000 + i) for i in range(8)],
            eval_every=2,
        )
        print(f"trained to policy version {policy.version}; the run is in {out / 'grpo'}")


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/guess")
    raise SystemExit(run(lambda interrupts: main(out, interrupts)))
