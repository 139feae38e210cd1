"""Reward selection: what a hand the model left unfinished is worth."""

from __future__ import annotations

from typing import Self

from plies import Status, Trajectory
from plies.harness import EpisodeLimits, ToolCallingHarness
from plies.policy import PolicyClient, SamplingParams
from plies.runtime import EpisodeContext
from plies.tokens import ChatRenderer

from .config import SYSTEM_PROMPT, Budget

__all__ = ["FORFEIT", "Forfeiting"]

FORFEIT = -1.0
"""The reward of a hand the model did not finish (ill-formed call, or out of tokens or turns):
scored as a loss, so evaluation counts it and GRPO learns to avoid it."""


class Forfeiting:
    """The harness's episode, with a hand the model left unfinished scored as `FORFEIT`.

    Reward selection stays in the script: the harness reports how an episode ended, the recipe
    decides what that is worth.
    """

    def __init__(self, harness: ToolCallingHarness):
        self.harness = harness

    @classmethod
    def for_budget(cls, renderer: ChatRenderer, policy: PolicyClient, budget: Budget) -> Self:
        """The recipe's harness: one tool call a turn, sampled at temperature 1 as GRPO's
        importance sampling assumes, within the budget's tokens and turns."""
        return cls(
            ToolCallingHarness(
                renderer,
                policy,
                SamplingParams(max_tokens=budget.max_new_tokens, temperature=1.0),
                limits=EpisodeLimits(max_turns=budget.max_turns),
                system_prompt=SYSTEM_PROMPT,
                ill_formed_reward=FORFEIT,
            )
        )

    async def play(self, ctx: EpisodeContext) -> Trajectory:
        traj = await self.harness.play(ctx)
        if traj.status is Status.TRUNCATED and traj.reward is None:
            return traj.model_copy(update={"reward": FORFEIT})  # settled records are final
        return traj
