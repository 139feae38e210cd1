"""Held-out evaluation: the same deals before and after training, so the comparison is paired."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import anyio

from plies import AdmissionClosed, PolicyRef
from plies.environments import Task
from plies.runtime import GroupSpec, Interrupts, RolloutDriver, RolloutResources

from .config import EVAL_SEEDS
from .rewards import Forfeiting
from .state import Interrupted, RunState

__all__ = ["EvalResult", "evaluate", "play_held_out"]


@dataclass(frozen=True, slots=True)
class EvalResult:
    """What `play_held_out` measured."""

    mean_return: float
    hands: int
    """Hands that ended with a reward (system failures excluded)."""
    ill_formed: int
    failed: int
    """Hands without a reward: an error of the system, not a move of the model."""
    stand_rate: float
    """Share of decisions that were `stand`."""


async def play_held_out(
    resources: RolloutResources,
    harness: Forfeiting,
    policy: PolicyRef,
    hands: int,
    concurrency: int,
    interrupts: Interrupts,
) -> EvalResult:
    """Play `hands` held-out deals under `policy`; ill-formed hands count as lost (-1).

    Raises:
        Interrupted: Ctrl-C arrived; what was in flight settled first.
    """
    rewards: list[float] = []
    ill = failed = stands = decisions = 0
    async with RolloutDriver(
        resources, harness.play, policy=policy, max_groups_in_flight=concurrency
    ) as driver:
        interrupts.attach(driver)

        async def admit() -> None:
            for i in range(hands):
                spec = GroupSpec(
                    task_id=f"eval-{i}", size=1, task=Task(id=f"eval-{i}", seed=EVAL_SEEDS + i)
                )
                try:
                    await driver.admit(spec)
                except AdmissionClosed:
                    return
            driver.close_admission()

        async with anyio.create_task_group() as tg:
            tg.start_soon(admit)
            async for group in driver.groups():
                traj = group.trajectories[0]
                if traj.reward is None:
                    failed += 1
                    continue
                rewards.append(traj.reward)
                ill += traj.info.get("stop_reason") == "ill_formed"
                for turn in traj.turns:
                    calls = (turn.message or {}).get("tool_calls") or []
                    decisions += len(calls)
                    stands += sum(c["function"]["name"] == "stand" for c in calls)
    if interrupts.count:
        raise Interrupted
    mean = sum(rewards) / len(rewards) if rewards else float("nan")
    return EvalResult(mean, len(rewards), ill, failed, stands / decisions if decisions else 0.0)


async def evaluate(
    run: RunState, policy: PolicyRef, hands: int, label: str, step: int
) -> dict[str, Any]:
    """Evaluate `policy` once per (label, step): a resumed run reads the logged result back."""
    done = run.log.last("eval", label=label, step=step)
    if done is not None:
        return done
    t0 = time.monotonic()
    result = await play_held_out(
        run.resources, run.harness, policy, hands, run.budget.eval_concurrency, run.interrupts
    )
    record = run.log.write(
        "eval", label=label, step=step, policy=policy.version, seconds=time.monotonic() - t0,
        **{"return": result.mean_return}, hands=result.hands, ill_formed=result.ill_formed,
        failed=result.failed, stand_rate=result.stand_rate,
    )  # fmt: skip
    run.console.print(
        f"eval \\[{label}] step {step}: return {result.mean_return:+.3f} over {result.hands} "
        f"hands (ill-formed {result.ill_formed}, stand rate {result.stand_rate:.2f}, "
        f"{record['seconds']:.0f}s)"
    )
    return record
