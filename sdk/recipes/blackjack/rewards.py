"""Reward selection: what a hand the model left unfinished is worth."""

from __future__ import annotations

from plies import Status, Trajectory
from plies.harness import ToolCallingHarness
from plies.runtime import EpisodeContext

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

    async def play(self, ctx: EpisodeContext) -> Trajectory:
        traj = await self.harness.play(ctx)
        if traj.status is Status.TRUNCATED and traj.reward is None:
            return traj.model_copy(update={"reward": FORFEIT})  # settled records are final
        return traj
