"""GRPO with resume: groups sampled ahead under a bounded lag, trained in steps taken once.

Each group is G episodes of one seeded deal (rewards differ only by the actions); advantages
are each reward minus the group mean; `training_groups` checks every group before training.
A group that is refused or tied is set aside as it arrives and another is sampled (dynamic
sampling), so every step trains on `groups_per_step` groups that carry a signal.
Completed groups are fsynced to `groups.jsonl` before training sees them, and each step is
announced in the run log (`step_begin`, with its groups) before it is sent, so a step cut off
midway is replayed on the same groups with the same op ids.
"""

from __future__ import annotations

import time
from typing import Any

import anyio

from plies import AdmissionClosed, ConfigError, Group, PolicyRef
from plies.environments import Task
from plies.policy import TinkerPolicyClient, VLLMClient, policy_path, unload_lora_adapter
from plies.runtime import GroupSpec, JsonlSink, RolloutDriver, read_groups
from plies.training import Trainer, grpo_advantages, training_batch, training_groups
from plies.wire import served_name

from .config import MAX_STALENESS, TRAIN_SEEDS, Budget
from .contrast import DecisionTokens, decision_tokens, state_contrast
from .evaluation import evaluate
from .report import idle_streak, set_aside_counts, step_line, stopped_line
from .state import Interrupted, RunState
from .warm_start import train_step

__all__ = ["grpo", "retrain", "train_on"]


async def train_on(
    trainer: Trainer,
    step: int,
    groups: list[Group],
    policy: PolicyRef,
    budget: Budget,
    *,
    decisions: DecisionTokens | None = None,
) -> tuple[PolicyRef | None, dict[str, Any]]:
    """One GRPO step on `groups`: check, advantages, importance sampling, save.

    `decisions` locates the hit/stand token, which `budget.advantages == "state_contrast"`
    needs.

    Returns:
        The new policy (None when every group tied: nothing to learn, nothing published) and
        the step's record fields.
    """
    selection = training_groups(groups, policy=policy, max_staleness=MAX_STALENESS)
    refused = [f"{r.group_id}: {r.reason.value}" for r in selection.refused]
    rewards = [t.reward for g in selection.trainable for t in g.trajectories]
    info: dict[str, Any] = {
        "groups": [g.id for g in groups],
        "trainable": len(selection.trainable),
        "refused": refused,
        "train_return": sum(rewards) / len(rewards) if rewards else None,
    }
    advantages = [grpo_advantages([t.reward for t in g.trajectories]) for g in selection.trainable]
    info["tied"] = sum(not any(adv) for adv in advantages)  # members all scored alike
    if not any(a for adv in advantages for a in adv):
        return None, info
    batch = training_batch(
        selection.trainable, advantages, temperature=1.0, top_p=budget.top_p, skip_zero=True
    )
    if budget.advantages == "state_contrast":
        if decisions is None:
            raise ConfigError("state_contrast advantages need the decision tokens")
        batch = state_contrast(batch, decisions, share=budget.contrast_share)
    fb, opt = await train_step(trainer, f"grpo-{step}", batch, loss=budget.loss, lr=budget.lr)
    # Every metric the trainer reported (loss, tokens, ratios, KL...): `plies replay
    # --train-only` re-feeds this batch and compares them all.
    info.update(fb, grad_norm=opt.get("grad_norm"))
    new = await trainer.save_policy(op_id=f"grpo-{step}-save")
    return new, info


async def retrain(
    trainer: Trainer, step: int, groups: list[Group], policy: PolicyRef, run: dict[str, Any]
) -> dict[str, Any]:
    """`train_on` as the run whose `run.json` is `run` took step `step`: the fields its step
    record holds, recomputed (`plies replay --train-only`, with a trainer restored at it).

    Raises:
        ConfigError: `run` is not a native-trainer Blackjack run (no budget recorded, or the
            steps went through the Tinker API, whose losses are summed, not averaged).
    """
    config = run.get("config") if isinstance(run.get("config"), dict) else {}
    if config.get("trainer", "native") != "native":
        raise ConfigError(
            f"the run was trained through the Tinker API (--trainer {config['trainer']}); "
            "--train-only re-feeds steps of the native trainer"
        )
    try:
        budget = Budget(**run["budget"])
    except (KeyError, TypeError) as exc:
        raise ConfigError(
            f"run.json records no Blackjack budget ({exc!r}); --train-only re-feeds steps of "
            "plies demo blackjack"
        ) from None
    decisions = None
    if budget.advantages == "state_contrast":  # the policy directory carries its tokenizer
        from transformers import AutoTokenizer

        decisions = decision_tokens(AutoTokenizer.from_pretrained(policy_path(policy)))
    _, info = await train_on(trainer, step, groups, policy, budget, decisions=decisions)
    return info


def set_aside_reason(group: Group, policy: PolicyRef, group_size: int) -> str | None:
    """Why `group` cannot teach the next step (refused by the checks, "certain" or "tied"),
    else None.

    Groups are judged as they arrive, so a batch is filled with groups that carry a signal
    (dynamic sampling, as DAPO does): once the policy plays most deals one way, most groups
    tie, and a batch of the first `groups_per_step` groups trained on one or two of them,
    a step as large as a full batch's driven by a group or two's noise. A "certain" group
    holds one member, every token of it drawn with certainty: the driver did not play the
    others, which would have repeated it (`GroupSpec.deterministic`).
    """
    if group.size == 1 < group_size:
        return "certain"
    selection = training_groups([group], policy=policy, max_staleness=MAX_STALENESS)
    if selection.refused:
        return selection.refused[0].reason.value
    if not any(grpo_advantages([t.reward for t in group.trajectories])):
        return "tied"
    return None


def _train_spec(index: int, budget: Budget) -> GroupSpec:
    """Group `index` of training: `group_size` episodes of the deal seeded `TRAIN_SEEDS + index`."""
    task_id = f"train-{index}"
    return GroupSpec(
        task_id=task_id,
        size=budget.group_size,
        task=Task(id=task_id, seed=TRAIN_SEEDS + index),
        id=task_id,
        deterministic=True,  # a hand is its deal and its calls: a certain member is them all
    )


def _group_index(group_id: str) -> int:
    return int(group_id.removeprefix("train-"))


def _untrained(run: RunState, step: int) -> tuple[list[Group], int]:
    """Completed groups no step trained on, the cut-off step's own first; the next index.

    Lines of `groups.jsonl` that do not read back are groups a crash cut off while they were
    written: they were never trained on, and are reported rather than skipped silently.
    """
    read = read_groups(run.out / "groups.jsonl")
    if read.malformed:
        lines = ", ".join(str(m.line) for m in read.malformed)
        run.console.print(
            f"[yellow]groups.jsonl[/]: line(s) {lines} do not read back (cut off by a crash); "
            "those groups were never trained on and are left out"
        )
    # A batch that trained nothing (`skipped`) and a group set aside used their groups up too.
    kinds = ("step", "skipped", "set_aside")
    trained = {g for kind in kinds for r in run.log.all(kind) for g in r["groups"]}
    waiting = [g for g in read.records if g.id not in trained]
    begun = run.log.last("step_begin", step=step)
    if begun is not None:  # a step was cut off: replay it on the same groups, same op ids
        chosen = set(begun["groups"])
        waiting = [g for g in waiting if g.id in chosen] + [
            g for g in waiting if g.id not in chosen
        ]
    next_index = max((_group_index(g.id) for g in read.records), default=-1) + 1
    return waiting, next_index


async def grpo(run: RunState, policy: PolicyRef) -> None:
    """Train from `policy` until the budget's steps are logged; resumable at any point.

    Raises:
        Interrupted: Ctrl-C arrived; in-flight groups drained to disk for the next run.
    """
    budget = run.budget
    step = len(run.log.all("step"))
    if (
        step >= budget.grpo_steps
        or idle_streak(run.log, budget.group_size) >= budget.max_idle_episodes
    ):
        return
    if _curve_due(budget, step):  # cut off by Ctrl-C after its step was logged
        await evaluate(run, policy, budget.curve_hands, "curve", step)
    waiting, next_index = _untrained(run, step)
    if waiting:
        run.console.print(f"resuming at step {step} with {len(waiting)} completed untrained groups")
    served = {policy.version}
    decisions = decision_tokens(run.tokenizer)

    with (
        JsonlSink(run.out / "groups.jsonl") as sink,
        run.progress.phase("GRPO steps", budget.grpo_steps, completed=step) as phase,
    ):
        async with RolloutDriver(
            run.resources, run.harness.play, policy=policy,
            max_groups_in_flight=budget.groups_in_flight, sink=sink,
        ) as driver, run.progress.sampling(phase, driver):  # fmt: skip
            run.interrupts.attach(driver)

            async def admit() -> None:
                index = next_index
                while True:
                    try:
                        await driver.admit(_train_spec(index, budget))
                    except AdmissionClosed:
                        return
                    index += 1

            def stop_if_idle() -> bool:
                """Stop sampling once `MAX_IDLE_BATCHES` batches' worth of episodes in a row
                trained nothing; True if so."""
                if idle_streak(run.log, budget.group_size) < budget.max_idle_episodes:
                    return False
                run.console.print(stopped_line(step, budget.max_idle_episodes))
                driver.cancel()
                return True

            async def consume() -> None:
                nonlocal step, policy, waiting
                stopped = False  # GRPO ended early: batches in a row trained nothing
                async for group in driver.groups():
                    if run.interrupts.count or step >= budget.grpo_steps or stopped:
                        continue  # drained groups are on disk; a resumed run trains them
                    why = set_aside_reason(group, policy, budget.group_size)
                    if why is not None:
                        run.log.write(
                            "set_aside", step=step, groups=[group.id], reason=why,
                            episodes=group.size,
                        )  # fmt: skip
                        stopped = stop_if_idle()
                        continue
                    waiting.append(group)
                    if len(waiting) < budget.groups_per_step:
                        continue
                    batch, waiting = (
                        waiting[: budget.groups_per_step],
                        waiting[budget.groups_per_step :],
                    )
                    run.log.write("step_begin", step=step, groups=[g.id for g in batch])
                    t0 = time.monotonic()
                    new, info = await train_on(
                        run.trainer, step, batch, policy, budget, decisions=decisions
                    )
                    aside = set_aside_counts(run.log)  # in the log already, one per group
                    if new is None:  # nothing to learn: not a step, sample another batch
                        run.log.write("skipped", step=step, seconds=time.monotonic() - t0, **info)
                        run.console.print(step_line(step, info, None, aside))
                        stopped = stop_if_idle()
                        continue
                    await run.publish(new)
                    driver.set_policy(new)
                    policy = new
                    served.add(new.version)
                    run.log.write(
                        "step", step=step, policy=policy.model_dump(),
                        seconds=time.monotonic() - t0, **info,
                    )  # fmt: skip
                    run.console.print(step_line(step, info, policy, aside))
                    step += 1
                    phase.advance()
                    await _unload_unused(run.client, served, policy)
                    if _curve_due(budget, step):
                        try:
                            await evaluate(run, policy, budget.curve_hands, "curve", step)
                        except Interrupted:
                            continue  # drain to disk; raised below, outside the task group
                    if step >= budget.grpo_steps:
                        driver.cancel()  # groups still sampling are not needed

            async with anyio.create_task_group() as tg:
                tg.start_soon(admit)
                await consume()
    run.stop_if_interrupted()


def _curve_due(budget: Budget, step: int) -> bool:
    """A learning-curve point is evaluated after every `curve_every`-th step but the last."""
    every = budget.curve_every
    return bool(every) and 0 < step < budget.grpo_steps and step % every == 0


async def _unload_unused(
    client: VLLMClient | TinkerPolicyClient, served: set[int], policy: PolicyRef
) -> None:
    """Stop serving versions no admitted group can still sample from (memory stays flat).

    Groups in flight are at most `MAX_STALENESS` steps behind the newest policy: the driver
    admits at most that many steps' worth of groups ahead of training. A Tinker sampler
    holds nothing here (the service keeps the weights), so there is nothing to unload.
    """
    if isinstance(client, TinkerPolicyClient):
        return
    for version in sorted(v for v in served if v < policy.version - MAX_STALENESS):
        await unload_lora_adapter(client, served_name(version))
        served.discard(version)
