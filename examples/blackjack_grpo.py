"""Blackjack GRPO on the tiny Qwen3 model, written out on plies' public API.

    python examples/blackjack_grpo.py --out runs/blackjack-example [--budget smoke|quick|default]

The job, top to bottom: start the reference server (it samples and trains), warm-start the
model on transcripts of simple players so that it emits well-formed tool calls, evaluate it on
held-out deals, then `plies.rl.train`: groups of episodes of one deal each, checked, each
member's reward minus the group mean, one step per batch, each new policy published and
sampled from. Evaluate again on the same deals. Ctrl-C drains what is in flight and exits
with 130; the same command resumes (the trainer's journal answers the warm start's steps, and
`plies.rl.train` resumes its run directory).

This is the shape to copy. `plies demo blackjack` (`plies.recipes.blackjack`) runs the same
job with what a long run needs on top: a learning curve, exact pricing of the policy, a
report, OpenEnv and sandboxed envs, the Tinker API.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import anyio
from transformers import AutoTokenizer

from plies import PolicyRef, rl
from plies.environments import BlackjackEnv, Task
from plies.policy import VLLMClient, publish
from plies.recipes.blackjack import BUDGETS, Budget
from plies.recipes.blackjack.config import TEMPLATE_KWARGS, TRAIN_SEEDS
from plies.recipes.blackjack.evaluation import held_out
from plies.recipes.blackjack.rewards import harness_for_budget
from plies.recipes.blackjack.warm_start import transcripts, warm_start
from plies.runtime import EnvPool, Interrupts, RolloutResources, run
from plies.testing import plies_command, serve_process, tiny_model_dir
from plies.tokens import ChatRenderer
from plies.training import TrainingClient


async def blackjack_grpo(out: Path, budget: Budget, interrupts: Interrupts) -> None:
    model_dir = await anyio.to_thread.run_sync(tiny_model_dir)  # the offline kit, cached
    tokenizer = await anyio.to_thread.run_sync(AutoTokenizer.from_pretrained, model_dir)
    renderer = ChatRenderer(tokenizer, template_kwargs=dict(TEMPLATE_KWARGS))
    serve = plies_command("serve", str(model_dir), "--state-dir", str(out / "server"))

    async def new_env() -> BlackjackEnv:
        return BlackjackEnv()

    def stop_if_interrupted(*_: object) -> None:
        if interrupts.count:
            raise rl.Interrupted

    async with (
        serve_process(serve, log=out / "server.log") as server,
        TrainingClient(server.url) as trainer,
        VLLMClient(server.url, server.ready["model"]) as sampler,
        RolloutResources(
            sampler=sampler,
            pools=[EnvPool(new_env, limit=budget.eval_concurrency)],
            report_path=out / "quarantine.json",
        ) as resources,
    ):
        # The tool-calling harness under the budget; a hand left unfinished scores FORFEIT.
        harness = harness_for_budget(renderer, sampler, budget)

        async def evaluate(policy: PolicyRef, label: str) -> float:
            played = await rl.play_tasks(
                resources, harness.play, policy, held_out(budget.eval_hands),
                concurrency=budget.eval_concurrency, interrupts=interrupts,
            )  # fmt: skip
            mean, stderr = rl.mean_stderr([t.reward for t in played if t and t.reward is not None])
            print(f"{label}: return {mean:+.3f} (95% CI {rl.ci95(mean, stderr)}) held out")
            return mean

        # 1. Warm start: supervised steps teach the tool-call format (and, with
        #    `thresholds` players, to read the total), not a strategy. Steps the trainer
        #    already applied (a resumed run) are answered from its journal.
        base = PolicyRef.model_validate(server.ready["policy"])
        data = await transcripts(
            renderer, tokenizer, budget.warm_hands, policy=base, players=budget.warm_players
        )
        policy = await warm_start(trainer, data, budget, on_step=stop_if_interrupted)
        await publish(policy, [sampler])
        before = await evaluate(policy, "warm start")

        # 2. GRPO: groups of one deal each, trained as they complete, in a run directory;
        # of the policies it publishes (a model directory each) only the newest stays.
        policy = await rl.train(
            out / "grpo",
            budget.grpo,
            tasks=lambda i: Task(id=f"train-{i}", seed=TRAIN_SEEDS + i),
            env=new_env,
            play=harness.play,
            trainer=trainer,
            sampler=sampler,
            policy=policy,
            interrupts=interrupts,
            keep_policies=1,
        )
        if interrupts.count:
            return

        # 3. The same held-out deals again: a paired comparison.
        after = await evaluate(policy, "after GRPO")
    summary = {"warm_start_return": before, "final_return": after, "policy": policy.version}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/blackjack-example"))
    parser.add_argument("--budget", choices=sorted(BUDGETS), default="default")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    async def job(interrupts: Interrupts) -> None:
        try:
            await blackjack_grpo(args.out, BUDGETS[args.budget], interrupts)
        except rl.Interrupted:
            print("interrupted", file=sys.stderr)

    return run(job)


if __name__ == "__main__":
    raise SystemExit(main())
