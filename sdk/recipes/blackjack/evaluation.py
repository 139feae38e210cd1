"""Held-out evaluation: the same deals before and after training, so the comparison is paired."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio

from plies import AdmissionClosed, PolicyRef, Status
from plies.environments import Task
from plies.environments.blackjack_exact import Cell, Decision, hand_of
from plies.harness import ToolCallingHarness
from plies.rl import Z95, Interrupted, mean_stderr
from plies.runtime import GroupSpec, Interrupts, RolloutDriver, RolloutResources

from .config import EVAL_SEEDS
from .state import RunState

__all__ = ["EvalResult", "evaluate", "play_held_out"]


@dataclass(frozen=True, slots=True)
class EvalResult:
    """What `play_held_out` measured."""

    mean_return: float
    hands: int
    """Hands that ended with a reward (system failures excluded)."""
    ill_formed: int
    truncated: int
    """Hands cut off by a budget (a completion at `max_new_tokens`, or out of turns): scored
    as lost, like an ill-formed one."""
    failed: int
    """Hands without a reward: an error of the system, not a move of the model."""
    stand_rate: float
    """Share of decisions that were `stand`."""
    rewards: tuple[float | None, ...]
    """Each held-out hand's reward by its index (None: failed), so two evaluations pair up."""
    decisions: tuple[Decision, ...]
    """Every hit/stand decision with the state it was taken in (the strategy grid's data)."""
    forfeits: tuple[Cell, ...]
    """The state of each hand left unfinished (`hand_of`): with `decisions`, what
    `blackjack_exact.price` prices."""


async def play_held_out(
    resources: RolloutResources,
    harness: ToolCallingHarness,
    policy: PolicyRef,
    hands: int,
    concurrency: int,
    interrupts: Interrupts,
    *,
    on_hand: Callable[[], None] | None = None,
) -> EvalResult:
    """Play `hands` held-out deals under `policy`; ill-formed hands count as lost (-1).

    `on_hand` is called as each hand ends (a progress display).

    Raises:
        Interrupted: Ctrl-C arrived; what was in flight settled first.
    """
    by_hand: list[float | None] = [None] * hands
    seen: list[Decision] = []
    forfeits: list[Cell] = []
    ill = truncated = failed = stands = decisions = 0
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
                if on_hand is not None:
                    on_hand()
                traj = group.trajectories[0]
                if traj.reward is None:
                    failed += 1
                    continue
                index = int(group.task_id.removeprefix("eval-"))
                by_hand[index] = traj.reward
                hand = hand_of(traj, EVAL_SEEDS + index)
                seen.extend(hand.decisions)
                if hand.forfeit is not None:
                    forfeits.append(hand.forfeit)
                ill += traj.info.get("stop_reason") == "ill_formed"
                truncated += traj.status is Status.TRUNCATED
                for turn in traj.turns:
                    calls = (turn.message or {}).get("tool_calls") or []
                    decisions += len(calls)
                    stands += sum(c["function"]["name"] == "stand" for c in calls)
    if interrupts.count:
        raise Interrupted
    rewards = [r for r in by_hand if r is not None]
    mean = sum(rewards) / len(rewards) if rewards else float("nan")
    return EvalResult(
        mean, len(rewards), ill, truncated, failed, stands / decisions if decisions else 0.0,
        tuple(by_hand), tuple(seen), tuple(forfeits),
    )  # fmt: skip


async def evaluate(
    run: RunState, policy: PolicyRef, hands: int, label: str, step: int
) -> dict[str, Any]:
    """Evaluate `policy` once per (label, step): a resumed run reads the logged result back."""
    done = run.log.last("eval", label=label, step=step)
    if done is not None:
        return done
    t0 = time.monotonic()
    with run.progress.phase(f"evaluation [{label}]", hands) as phase:
        result = await play_held_out(
            run.resources, run.harness, policy, hands, run.budget.eval_concurrency,
            run.interrupts, on_hand=phase.advance,
        )  # fmt: skip
    record = run.log.write(
        "eval", label=label, step=step, policy=policy.version, seconds=time.monotonic() - t0,
        **{"return": result.mean_return}, hands=result.hands, ill_formed=result.ill_formed,
        truncated=result.truncated, failed=result.failed, stand_rate=result.stand_rate,
        stderr=mean_stderr([r for r in result.rewards if r is not None])[1],
        rewards=list(result.rewards), decisions=[list(d) for d in result.decisions],
        forfeits=[list(f) for f in result.forfeits],
    )  # fmt: skip
    run.console.print(
        f"eval \\[{label}] step {step}: return {result.mean_return:+.3f} "
        f"± {Z95 * record['stderr']:.3f} (95% CI) over {result.hands} "
        f"hands (ill-formed {result.ill_formed}, cut off {result.truncated}, "
        f"stand rate {result.stand_rate:.2f}, {record['seconds']:.0f}s)"
    )
    return record
