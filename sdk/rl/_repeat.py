"""Groups of a seeded task whose first member drew every token with certainty.

A seeded environment's episode is a function of its task and the tokens the policy samples.
When a group's first member drew every token with certainty (logprob exactly 0: alone in
its nucleus), every other member would sample the same tokens and play the same episode, so
`repeat_certain` has them repeat its record instead of playing: the group still holds all its
members, as if each had played, at the cost of one episode. With nucleus sampling most groups
of a sharp policy are such groups, and GRPO learns nothing from them (they tie); playing one
member rather than all is what makes them cheap. It is an episode wrapper, so the drivers
know nothing of it, and it works wherever an episode runs (a shard included).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio

from plies import Group, Status, Trajectory
from plies.runtime import EpisodeContext

__all__ = ["REPEATS", "played", "repeat_certain"]

Episode = Callable[[EpisodeContext], Awaitable[Trajectory]]

REPEATS = "repeats"
"""The `Trajectory.info` key of a member that repeated its group's first member instead of
playing; the value is that member's trajectory id."""


def played(group: Group) -> int:
    """Members of `group` that played their episode (the others repeated the first)."""
    return sum(REPEATS not in t.info for t in group.trajectories)


class _First:
    """A group's first member, as the others wait for it."""

    __slots__ = ("done", "readers", "record")

    def __init__(self, readers: int) -> None:
        self.done = anyio.Event()
        self.readers = readers
        self.record: Trajectory | None = None
        """Member 0's record, when it completed and drew every token with certainty."""


def repeat_certain(play: Episode) -> Episode:
    """`play`, with each group's members after the first waiting for it, and repeating it
    when it was certain (`REPEATS`); otherwise they play as usual.

    Only for tasks whose episode is fixed by its sampled tokens (a seeded environment, no
    clock, no outside state): elsewhere a repeat would not be what the member would have
    played. A first member that failed, was cancelled or left an operation unsettled is not
    certain, and the others then play.
    """
    firsts: dict[str, _First] = {}

    async def episode(ctx: EpisodeContext) -> Trajectory:
        if ctx.group_size == 1:
            return await play(ctx)
        first = firsts.get(ctx.group_id)
        if first is None:
            first = firsts[ctx.group_id] = _First(ctx.group_size)
        try:
            if ctx.index == 0:
                try:
                    record = await play(ctx)
                    if _certain(record) and not any(lease.unsettled for lease in ctx.leases):
                        first.record = record
                    return record
                finally:
                    first.done.set()
            await first.done.wait()
            if first.record is not None:
                # Sampled once, by member 0: the driver's turn count (turns/s) stays the
                # turns sampled, so the repeat's are marked as counted already.
                ctx.turns_counted = len(first.record.turns)
                info = {**first.record.info, REPEATS: first.record.id}
                return first.record.model_copy(update={"id": ctx.trajectory.id, "info": info})
        finally:
            first.readers -= 1
            if not first.readers:
                del firsts[ctx.group_id]
        return await play(ctx)

    return episode


def _certain(traj: Trajectory) -> bool:
    """The episode completed and drew every token with certainty (logprob exactly 0)."""
    return (
        traj.status in (None, Status.COMPLETED)
        and bool(traj.turns)
        and all(lp == 0.0 for turn in traj.turns for lp in turn.logprobs)
    )
