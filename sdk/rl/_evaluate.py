"""Held-out evaluation: a policy played once on each of a fixed list of tasks, logged once.

The same tasks before and after training make the two evaluations pair up task by task
(`paired_improvement`), so each evaluation records every task's reward by its index, not only
the mean. A failed episode (an error of the system, not a move of the model) has no reward:
it is counted apart and left out of the mean rather than scored as a loss.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from plies import AdmissionClosed, PolicyRef, Trajectory
from plies.environments import Task
from plies.runtime import GroupSpec, Interrupts, RolloutDriver, RolloutResources

from ._grpo import Episode, Interrupted, Run
from ._stats import Z95, mean_stderr

__all__ = ["Observe", "evaluate", "play_tasks"]

Observe = Callable[[Sequence[Trajectory | None]], dict[str, Any]]
"""What a recipe adds to an evaluation's record, from the episodes in task order."""


async def play_tasks(
    resources: RolloutResources,
    play: Episode,
    policy: PolicyRef,
    tasks: Sequence[Task],
    *,
    concurrency: int,
    interrupts: Interrupts,
    on_episode: Callable[[], None] | None = None,
) -> list[Trajectory | None]:
    """Play `policy` once on each of `tasks`, at most `concurrency` at a time.

    Returns:
        Each task's episode, in the order of `tasks` (None: its episode never came back, as
        when the driver lost it).

    Raises:
        Interrupted: Ctrl-C arrived; the episodes in flight settled first.
    """
    played: list[Trajectory | None] = [None] * len(tasks)
    async with RolloutDriver(
        resources, play, policy=policy, max_groups_in_flight=concurrency
    ) as driver:
        interrupts.attach(driver)

        async def admit() -> None:
            for index, task in enumerate(tasks):
                try:
                    await driver.admit(GroupSpec(task_id=task.id, size=1, task=task, id=str(index)))
                except AdmissionClosed:
                    return
            driver.close_admission()

        async with anyio.create_task_group() as tg:
            tg.start_soon(admit)
            async for group in driver.groups():
                played[int(group.id)] = group.trajectories[0]
                if on_episode is not None:
                    on_episode()
    if interrupts.count:
        raise Interrupted
    return played


async def evaluate(
    run: Run,
    policy: PolicyRef,
    tasks: Sequence[Task],
    *,
    label: str,
    step: int,
    concurrency: int = 64,
    observe: Observe | None = None,
) -> dict[str, Any]:
    """Evaluate `policy` on `tasks` once per (`label`, `step`); a resumed run reads it back.

    The `eval` record holds the mean return of the scored episodes with its standard error,
    how many were scored and how many failed, every task's reward by index (None: failed),
    and what `observe` adds.

    Raises:
        Interrupted: Ctrl-C arrived; nothing is logged, and a resumed run evaluates again.
    """
    done = run.log.last("eval", label=label, step=step)
    if done is not None:
        return done
    started = time.monotonic()
    with run.progress.phase(f"evaluation [{label}]", len(tasks)) as phase:
        played = await play_tasks(
            run.resources, run.play, policy, tasks, concurrency=concurrency,
            interrupts=run.interrupts, on_episode=phase.advance,
        )  # fmt: skip
    rewards = [None if traj is None else traj.reward for traj in played]
    scored = [r for r in rewards if r is not None]
    mean, stderr = mean_stderr(scored)
    observed = observe(played) if observe is not None else {}
    record = run.log.write(
        "eval", label=label, step=step, policy=policy.version,
        seconds=time.monotonic() - started, **{"return": mean}, stderr=stderr,
        episodes=len(scored), failed=len(rewards) - len(scored), rewards=rewards, **observed,
    )  # fmt: skip
    figures = [f"{len(rewards) - len(scored)} failed"] + [
        f"{name.replace('_', ' ')} {value:.2f}" if isinstance(value, float) else
        f"{name.replace('_', ' ')} {value}"
        for name, value in observed.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    ]  # fmt: skip
    run.console.print(
        f"eval \\[{label}] step {step}: return {mean:+.3f} ± {Z95 * stderr:.3f} (95% CI) "
        f"over {len(scored)} episodes ({', '.join(figures)}, {record['seconds']:.0f}s)"
    )
    return record
