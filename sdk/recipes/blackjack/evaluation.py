"""Held-out evaluation of Blackjack: `plies.rl.evaluate` on the same deals before and after
training (so the comparison is paired), with what the strategy grid and the exact pricing
need from each hand."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plies import PolicyRef, Status, Trajectory, rl
from plies.environments import Task
from plies.environments.blackjack_exact import hand_of

from .config import EVAL_SEEDS
from .state import RunState

__all__ = ["evaluate", "held_out", "tally"]


def held_out(hands: int) -> list[Task]:
    """The first `hands` held-out deals: the same ones at every evaluation of every run."""
    return [Task(id=f"eval-{i}", seed=EVAL_SEEDS + i) for i in range(hands)]


def tally(played: Sequence[Trajectory | None]) -> dict[str, Any]:
    """What the hands of a held-out evaluation (in `held_out`'s order) did besides scoring.

    `ill_formed` and `truncated` (cut off by `max_new_tokens` or out of turns) hands are
    scored as lost; `stand_rate` is the share of decisions that were `stand`; `decisions`
    holds every hit/stand with the state it was taken in (the strategy grid's data), and
    `forfeits` the state of each hand left unfinished: with `decisions`, what
    `blackjack_exact.price` prices.
    """
    decisions: list[list[Any]] = []
    forfeits: list[list[Any]] = []
    ill = truncated = calls = stands = 0
    for index, traj in enumerate(played):
        if traj is None or traj.reward is None:
            continue  # failed: an error of the system, not a move of the model
        hand = hand_of(traj, EVAL_SEEDS + index)
        decisions.extend(list(d) for d in hand.decisions)
        if hand.forfeit is not None:
            forfeits.append(list(hand.forfeit))
        ill += traj.info.get("stop_reason") == "ill_formed"
        truncated += traj.status is Status.TRUNCATED
        for turn in traj.turns:
            made = (turn.message or {}).get("tool_calls") or []
            calls += len(made)
            stands += sum(c["function"]["name"] == "stand" for c in made)
    return {
        "ill_formed": ill,
        "truncated": truncated,
        "stand_rate": stands / calls if calls else 0.0,
        "decisions": decisions,
        "forfeits": forfeits,
    }


async def evaluate(
    run: RunState, policy: PolicyRef, hands: int, label: str, step: int
) -> dict[str, Any]:
    """Evaluate `policy` on `hands` held-out deals once per (label, step); a resumed run reads
    the logged result back."""
    return await rl.evaluate(
        run.loop, policy, held_out(hands), label=label, step=step,
        concurrency=run.budget.eval_concurrency, observe=tally,
    )  # fmt: skip
