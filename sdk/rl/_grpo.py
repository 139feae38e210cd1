"""GRPO with resume: groups sampled ahead under a bounded lag, trained in steps taken once.

Each group is `group_size` episodes of one task (rewards differ only by the actions);
advantages are each reward minus the group mean; `training_groups` checks every group before
training. A group that is refused, tied or certain is set aside as it arrives and another is
sampled (dynamic sampling, as DAPO does), so every step trains on `groups_per_step` groups that
carry a signal. Completed groups are fsynced to `groups.jsonl` before training sees them, and
each step is announced in the run log (`step_begin`, with its groups) before it is sent, so a
step cut off midway is replayed on the same groups with the same op ids.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from rich.console import Console

from plies import AdmissionClosed, ConfigError, Group, PolicyRef, Trajectory
from plies.environments import Task
from plies.policy import TinkerPolicyClient, VLLMClient
from plies.runtime import (
    EpisodeContext,
    GroupSpec,
    Interrupts,
    JsonlSink,
    RolloutDriver,
    RolloutResources,
    read_jsonl,
)
from plies.training import (
    LossName,
    Trainer,
    TrainingBatch,
    grpo_advantages,
    training_batch,
    training_groups,
)

from ._lines import step_line, stopped_line
from ._progress import RunProgress
from ._repeat import played, repeat_certain
from ._runlog import RunLog
from ._step import train_step

__all__ = [
    "Episode",
    "GRPOConfig",
    "Interrupted",
    "Run",
    "Shape",
    "finished",
    "grpo",
    "idle_streak",
    "set_aside_counts",
    "set_aside_reason",
    "train_on",
]


Episode = Callable[[EpisodeContext], Awaitable[Trajectory]]
"""One episode of a group: `ToolCallingHarness.play`, an agent harness's, or your own."""


class Interrupted(Exception):
    """Ctrl-C arrived; the run stops after what it was doing settled (it resumes later)."""


@dataclass(frozen=True, slots=True)
class GRPOConfig:
    """What a GRPO phase does: how many steps, on how many groups of how many episodes.

    Raises:
        ConfigError: a number out of its range, or an unknown loss.
    """

    steps: int
    """GRPO steps to take (a batch whose groups all tied trains nothing and is not one)."""
    group_size: int = 16
    """Episodes of one task per group: at least 2, or a group mean says nothing."""
    groups_per_step: int = 8
    """Groups with a signal per step (dynamic sampling sets the others aside)."""
    lr: float = 1e-4
    """Adam's learning rate (gradients clipped at norm 1); depends on the model and on what
    trains (every weight or an adapter), so a run should choose it."""
    loss: LossName = "ppo"
    """`ppo` clips the ratio of the trainer's to the sampler's probability at 1 +- 0.2, so a
    group sampled a version or two back cannot push a token that has already moved."""
    top_p: float = 1.0
    """The nucleus the episodes were sampled with; the trainer takes logprobs from it too."""
    max_staleness: int = 2
    """Policy versions a group may lag the one it trains: the driver admits at most this many
    steps' worth of groups ahead of training, and `training_groups` refuses older ones."""
    max_idle_batches: int = 5
    """Batches' worth of episodes in a row that may train nothing before the phase stops: that
    much sampling without a signal means the policy has stopped exploring."""

    def __post_init__(self) -> None:
        least = {"steps": 1, "group_size": 2, "groups_per_step": 1, "max_staleness": 0}
        least["max_idle_batches"] = 1
        for name, floor in least.items():
            value = getattr(self, name)
            if not isinstance(value, int) or value < floor:
                raise ConfigError(f"GRPOConfig.{name} is {value!r}: an integer >= {floor}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"GRPOConfig.lr is {self.lr}: a finite number > 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"GRPOConfig.top_p is {self.top_p}: a share above 0, at most 1")
        if self.loss not in ("ppo", "importance_sampling"):
            raise ConfigError(f"GRPOConfig.loss is {self.loss!r}; known: ppo, importance_sampling")

    @property
    def groups_in_flight(self) -> int:
        """The driver's bound on groups admitted ahead of training (staleness by pacing)."""
        return max(1, self.max_staleness) * self.groups_per_step

    @property
    def max_idle_episodes(self) -> int:
        """Episodes in a row that may train nothing before the phase stops."""
        return self.max_idle_batches * self.groups_per_step * self.group_size


@dataclass(frozen=True, slots=True)
class Run:
    """The open resources one GRPO phase works with; the caller opens and closes them."""

    out: Path
    """The run directory: `groups.jsonl` is written here."""
    log: RunLog
    trainer: Trainer
    sampler: VLLMClient | TinkerPolicyClient
    """Episodes sample from it; versions no group can still sample from are unloaded."""
    resources: RolloutResources
    play: Episode
    publish: Callable[[PolicyRef], Awaitable[None]]
    """Serve a new policy for sampling (and drop what the run no longer keeps)."""
    console: Console
    interrupts: Interrupts
    progress: RunProgress

    def stop_if_interrupted(self) -> None:
        """Raise `Interrupted` once Ctrl-C arrived, between units of work."""
        if self.interrupts.count:
            raise Interrupted


Shape = Callable[[TrainingBatch, list[Group]], TrainingBatch]
"""Rewrites a step's batch before it is sent (e.g. other advantages); given its groups."""


async def train_on(
    trainer: Trainer,
    step: int,
    groups: list[Group],
    policy: PolicyRef,
    config: GRPOConfig,
    *,
    shape: Shape | None = None,
) -> tuple[PolicyRef | None, dict[str, Any]]:
    """One GRPO step on `groups`: check, advantages, importance sampling, save.

    Returns:
        The new policy (None when every group tied: nothing to learn, nothing published) and
        the step's record fields.
    """
    selection = training_groups(groups, policy=policy, max_staleness=config.max_staleness)
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
        selection.trainable, advantages, temperature=1.0, top_p=config.top_p, skip_zero=True
    )
    if shape is not None:
        batch = shape(batch, selection.trainable)
    fb, opt = await train_step(trainer, f"grpo-{step}", batch, loss=config.loss, lr=config.lr)
    # Every metric the trainer reported (loss, tokens, ratios, KL...): `plies replay
    # --train-only` re-feeds this batch and compares them all.
    info.update(fb, grad_norm=opt.get("grad_norm"))
    new = await trainer.save_policy(op_id=f"grpo-{step}-save")
    return new, info


def set_aside_reason(group: Group, policy: PolicyRef, config: GRPOConfig) -> str | None:
    """Why `group` cannot teach the next step (refused by the checks, "certain" or "tied"),
    else None.

    Groups are judged as they arrive, so a batch is filled with groups that carry a signal:
    once the policy plays most tasks one way, most groups tie, and a batch of the first
    `groups_per_step` groups would train on one or two of them, a step as large as a full
    batch's driven by a group or two's noise. A "certain" group played one member, every
    token of it drawn with certainty, and the others repeated it (`repeat_certain`; a run
    logged before that holds such a group as its one member).
    """
    if played(group) == 1 < config.group_size:
        return "certain"
    selection = training_groups([group], policy=policy, max_staleness=config.max_staleness)
    if selection.refused:
        return selection.refused[0].reason.value
    if not any(grpo_advantages([t.reward for t in group.trajectories])):
        return "tied"
    return None


def idle_streak(log: RunLog, group_size: int) -> int:
    """Episodes that trained nothing since the last step that trained (resumes included):
    their groups set aside as they arrived, or in a batch that trained nothing. A record
    without its episodes (a batch, or a log older than the field) held full groups."""
    streak = 0
    for record in reversed(log.records):
        if record["kind"] == "step":
            break
        if record["kind"] in ("skipped", "set_aside"):
            streak += record.get("episodes", len(record["groups"]) * group_size)
    return streak


def set_aside_counts(log: RunLog) -> dict[str, int]:
    """Why the groups set aside while the current batch filled were (reason: count)."""
    counts: Counter[str] = Counter()
    for record in reversed(log.records):
        if record["kind"] in ("step", "skipped"):
            break
        if record["kind"] == "set_aside":
            counts[record["reason"]] += 1
    return dict(counts)


def _group_id(index: int) -> str:
    return f"train-{index}"


def _group_index(group_id: str) -> int:
    return int(group_id.removeprefix("train-"))


def _untrained(run: Run, step: int) -> tuple[list[Group], int]:
    """Completed groups no step trained on, the cut-off step's own first; the next index.

    Lines of `groups.jsonl` that do not read back are groups a crash cut off while they were
    written: they were never trained on, and are reported rather than skipped silently.
    """
    read = read_jsonl(run.out / "groups.jsonl", Group)
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


def finished(log: RunLog, config: GRPOConfig) -> bool:
    """Whether the phase is over: its steps are logged, or it stopped for want of a signal."""
    steps = len(log.all("step"))
    return steps >= config.steps or idle_streak(log, config.group_size) >= config.max_idle_episodes


async def grpo(
    run: Run,
    policy: PolicyRef,
    config: GRPOConfig,
    tasks: Callable[[int], Task],
    *,
    deterministic: bool = False,
    shape: Shape | None = None,
    after_step: Callable[[int, PolicyRef], Awaitable[None]] | None = None,
) -> PolicyRef:
    """Train from `policy` until `config.steps` steps are logged; resumable at any point.

    `tasks(i)` is the task of the `i`-th group sampled (0, 1, ...: a resumed run continues
    the count). `deterministic`: a task's episode is fixed by its tokens alone, so a group
    whose first member was drawn with certainty plays only it (`repeat_certain`).
    `after_step(step, policy)` runs after each step is logged (a learning-curve evaluation,
    say), and again at a resume for the step the run stopped after, so it must skip work its
    log already holds; it may raise `Interrupted`, and the groups in flight then drain to disk
    first.

    Returns:
        The newest policy.

    Raises:
        Interrupted: Ctrl-C arrived; in-flight groups drained to disk for the next run.
    """
    step = len(run.log.all("step"))
    if finished(run.log, config):
        return policy
    if step and after_step is not None:  # cut off by Ctrl-C after its step was logged
        await after_step(step, policy)
    waiting, next_index = _untrained(run, step)
    if waiting:
        run.console.print(f"resuming at step {step} with {len(waiting)} completed untrained groups")
    served = {policy.version: policy}

    def spec(index: int) -> GroupSpec:
        task, gid = tasks(index), _group_id(index)
        return GroupSpec(task_id=task.id, size=config.group_size, task=task, id=gid)

    play = repeat_certain(run.play) if deterministic else run.play

    with (
        JsonlSink(run.out / "groups.jsonl") as sink,
        run.progress.phase("GRPO steps", config.steps, completed=step) as phase,
    ):
        async with RolloutDriver(
            run.resources, play, policy=policy,
            max_groups_in_flight=config.groups_in_flight, sink=sink,
        ) as driver, run.progress.sampling(phase, driver):  # fmt: skip
            run.interrupts.attach(driver)

            async def admit() -> None:
                index = next_index
                while True:
                    try:
                        await driver.admit(spec(index))
                    except AdmissionClosed:
                        return
                    index += 1

            def stop_if_idle() -> bool:
                """Stop sampling once `max_idle_episodes` in a row trained nothing; True if so."""
                if idle_streak(run.log, config.group_size) < config.max_idle_episodes:
                    return False
                run.console.print(stopped_line(step, config.max_idle_episodes))
                driver.cancel()
                return True

            async def train_ready() -> bool:
                """Train a step on every full batch waiting; True if the phase stopped idle."""
                nonlocal step, policy, waiting
                while len(waiting) >= config.groups_per_step and step < config.steps:
                    if run.interrupts.count:
                        return False
                    batch, waiting = (
                        waiting[: config.groups_per_step],
                        waiting[config.groups_per_step :],
                    )
                    run.log.write("step_begin", step=step, groups=[g.id for g in batch])
                    t0 = time.monotonic()
                    new, info = await train_on(
                        run.trainer, step, batch, policy, config, shape=shape
                    )
                    aside = set_aside_counts(run.log)  # in the log already, one per group
                    if new is None:  # nothing to learn: not a step, sample another batch
                        run.log.write("skipped", step=step, seconds=time.monotonic() - t0, **info)
                        run.console.print(step_line(step, info, None, aside))
                        if stop_if_idle():
                            return True
                        continue
                    await run.publish(new)
                    driver.set_policy(new)
                    policy = new
                    served[new.version] = new
                    run.log.write(
                        "step", step=step, policy=policy.model_dump(),
                        seconds=time.monotonic() - t0, **info,
                    )  # fmt: skip
                    run.console.print(step_line(step, info, policy, aside))
                    step += 1
                    phase.advance()
                    await _unload_unused(run.sampler, served, policy, config.max_staleness)
                    if after_step is not None and step < config.steps:
                        try:
                            await after_step(step, policy)
                        except Interrupted:
                            return False  # drain to disk; raised below, outside the task group
                if step >= config.steps:
                    driver.cancel()  # groups still sampling are not needed
                return False

            async def consume() -> None:
                # A resumed run trains the groups it completed before sampling more.
                stopped = await train_ready()
                async for group in driver.groups():
                    if run.interrupts.count or step >= config.steps or stopped:
                        continue  # drained groups are on disk; a resumed run trains them
                    why = set_aside_reason(group, policy, config)
                    if why is not None:
                        run.log.write(
                            "set_aside", step=step, groups=[group.id], reason=why,
                            episodes=played(group),
                        )  # fmt: skip
                        stopped = stop_if_idle()
                        continue
                    waiting.append(group)
                    stopped = await train_ready()

            async with anyio.create_task_group() as tg:
                tg.start_soon(admit)
                await consume()
    run.stop_if_interrupted()
    return policy


async def _unload_unused(
    sampler: VLLMClient | TinkerPolicyClient,
    served: dict[int, PolicyRef],
    policy: PolicyRef,
    staleness: int,
) -> None:
    """Stop serving versions no admitted group can still sample from (memory stays flat).

    Groups in flight are at most `staleness` steps behind the newest policy: the driver admits
    at most that many steps' worth of groups ahead of training.
    """
    for version in sorted(v for v in served if v < policy.version - staleness):
        await sampler.unload_policy(served.pop(version))
