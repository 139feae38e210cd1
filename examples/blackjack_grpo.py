"""Blackjack GRPO on the tiny Qwen3 model, written out on plies' public API.

    python examples/blackjack_grpo.py --out runs/blackjack-example [--budget smoke|quick|default]

The loop, top to bottom: start the reference server (it samples and trains), warm-start the
model on random-play transcripts so that it emits well-formed tool calls, evaluate it on
held-out deals, then GRPO: sample groups of episodes of one deal each, check them with
`training_groups`, give each member its reward minus the group mean, take one importance
sampling step, save and publish the new policy, and keep sampling under it. Evaluate again
on the same deals. Ctrl-C stops admitting, drains what is in flight and exits with 130.

This is the shape to copy. `plies demo blackjack` (`plies.recipes.blackjack`) runs the same
job with everything a long run needs on top: a run log, resume after Ctrl-C or a crash,
steps replayed exactly once, a learning curve, OpenEnv and sandboxed envs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import anyio
from transformers import AutoTokenizer

from plies import AdmissionClosed, Group, PolicyRef
from plies.environments import BlackjackEnv, Task
from plies.policy import VLLMClient, publish
from plies.recipes.blackjack import (
    BUDGETS,
    MAX_STALENESS,
    TEMPLATE_KWARGS,
    TRAIN_SEEDS,
    Budget,
    Interrupted,
    harness_for_budget,
    play_held_out,
    transcripts,
    warm_start,
)
from plies.runtime import (
    EnvPool,
    GroupSpec,
    Interrupts,
    JsonlSink,
    RolloutDriver,
    RolloutResources,
    run,
)
from plies.testing import plies_command, serve_process, tiny_model_dir
from plies.tokens import ChatRenderer
from plies.training import (
    AdamParams,
    TrainingClient,
    grpo_advantages,
    training_batch,
    training_groups,
)


async def grpo_step(
    trainer: TrainingClient,
    sampler: VLLMClient,
    groups: list[Group],
    policy: PolicyRef,
    budget: Budget,
) -> PolicyRef:
    """One step: check the groups, reward minus group mean, one update, publish the policy."""
    selection = training_groups(groups, policy=policy, max_staleness=MAX_STALENESS)
    advantages = [grpo_advantages([t.reward for t in g.trajectories]) for g in selection.trainable]
    if not any(a for group_advantages in advantages for a in group_advantages):
        print(f"every group tied or was refused ({len(selection.refused)}): nothing to learn")
        return policy
    batch = training_batch(selection.trainable, advantages, temperature=1.0, skip_zero=True)
    fb = await trainer.forward_backward(batch, loss="importance_sampling")
    await trainer.optim_step(AdamParams(lr=budget.lr, grad_clip=1.0))
    policy = await trainer.save_policy()
    await publish(policy, [sampler])
    print(f"policy v{policy.version}: loss {fb.metrics.get('loss', 0):.3f}")
    return policy


async def grpo(
    driver: RolloutDriver,
    trainer: TrainingClient,
    sampler: VLLMClient,
    policy: PolicyRef,
    budget: Budget,
    interrupts: Interrupts,
) -> tuple[PolicyRef, int]:
    """Admit training deals while training on the groups that complete; return the last
    policy and the steps taken. The driver's bound on groups in flight paces sampling."""

    async def admit() -> None:
        for index in itertools.count():
            task = Task(id=f"train-{index}", seed=TRAIN_SEEDS + index)
            try:  # waits while the driver has `max_groups_in_flight` groups out
                await driver.admit(GroupSpec(task_id=task.id, size=budget.group_size, task=task))
            except AdmissionClosed:  # Ctrl-C, or cancel() below
                return

    steps, batch = 0, []
    async with anyio.create_task_group() as tg:
        tg.start_soon(admit)
        async for group in driver.groups():
            if interrupts.count or steps == budget.grpo_steps:
                continue  # draining: these groups are on disk, not trained
            batch.append(group)
            if len(batch) == budget.groups_per_step:
                policy = await grpo_step(trainer, sampler, batch, policy, budget)
                driver.set_policy(policy)  # groups admitted from now on sample from it
                steps, batch = steps + 1, []
                if steps == budget.grpo_steps:
                    driver.cancel()  # the groups still sampling are not needed
    return policy, steps


async def blackjack_grpo(out: Path, budget: Budget, interrupts: Interrupts) -> None:
    model_dir = await anyio.to_thread.run_sync(tiny_model_dir)  # the offline kit, cached
    tokenizer = await anyio.to_thread.run_sync(AutoTokenizer.from_pretrained, model_dir)
    renderer = ChatRenderer(tokenizer, template_kwargs=dict(TEMPLATE_KWARGS))
    serve = plies_command("serve", str(model_dir), "--state-dir", str(out / "server"))

    async def new_env() -> BlackjackEnv:
        return BlackjackEnv()

    in_flight = MAX_STALENESS * budget.groups_per_step  # groups sampled ahead of training
    async with (
        serve_process(serve, log=out / "server.log") as server,
        TrainingClient(server.url) as trainer,
        VLLMClient(server.url, server.ready["model"]) as sampler,
        RolloutResources(
            policy=sampler,
            pools=[EnvPool(new_env, limit=budget.group_size * in_flight + budget.eval_concurrency)],
            report_path=out / "quarantine.json",
        ) as resources,
    ):
        # The tool-calling harness under the budget; a hand left unfinished scores FORFEIT.
        harness = harness_for_budget(renderer, sampler, budget)

        def stop_if_interrupted(*_: object) -> None:
            if interrupts.count:
                raise Interrupted

        async def evaluate(policy: PolicyRef, label: str) -> float:
            result = await play_held_out(
                resources, harness, policy, budget.eval_hands, budget.eval_concurrency, interrupts
            )
            print(f"{label}: return {result.mean_return:+.3f} over {result.hands} held-out hands")
            return result.mean_return

        # 1. Warm start: supervised steps teach the tool-call format (and, with
        #    `thresholds` players, to read the total), not a strategy.
        base = PolicyRef.model_validate(server.ready["policy"])
        data = await transcripts(
            renderer, tokenizer, budget.warm_hands, policy=base, players=budget.warm_players
        )
        policy = await warm_start(trainer, data, budget, on_step=stop_if_interrupted)
        await publish(policy, [sampler])
        before = await evaluate(policy, "warm start")

        # 2. GRPO: groups of one deal each, trained as they complete.
        with JsonlSink(out / "groups.jsonl") as sink:  # every completed group, fsynced
            async with RolloutDriver(
                resources, harness.play, policy=policy, max_groups_in_flight=in_flight, sink=sink
            ) as driver:
                interrupts.attach(driver)
                policy, steps = await grpo(driver, trainer, sampler, policy, budget, interrupts)

        # 3. The same held-out deals again: a paired comparison.
        after = await evaluate(policy, "after GRPO")
    summary = {"warm_start_return": before, "final_return": after, "grpo_steps": steps}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/blackjack-example"))
    parser.add_argument("--budget", choices=sorted(BUDGETS), default="default")
    args = parser.parse_args()
    if (args.out / "server").exists():
        parser.error(f"{args.out} holds an earlier run; choose a new --out")
    args.out.mkdir(parents=True, exist_ok=True)

    async def job(interrupts: Interrupts) -> None:
        try:
            await blackjack_grpo(args.out, BUDGETS[args.budget], interrupts)
        except Interrupted:
            print("interrupted", file=sys.stderr)

    return run(job)


if __name__ == "__main__":
    raise SystemExit(main())
