"""`training_groups`: the checks a group must pass before its tokens reach a trainer.

A GRPO baseline is only meaningful over the whole group, sampled by one policy, recently
enough that importance ratios stay near 1, with data that lines up token for token and
rewards that are numbers. A group that fails any check is refused as a whole, with a typed
reason, rather than trained on silently; the caller decides what to log or re-run.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from .._exceptions import ConfigError, TrajectoryError
from ..trajectory import Group, PolicyRef, Status, Trajectory
from ..wire.training import MIN_LOGPROB

__all__ = ["GroupSelection", "Refusal", "RefusalReason", "Truncated", "training_groups"]


class Truncated(StrEnum):
    """What to do with members whose episode ran out of budget (`Status.TRUNCATED`)."""

    TRAIN = "train"
    """Train them with the reward they got, like any other member."""
    REFUSE = "refuse"
    """Refuse the whole group when any member was truncated."""
    DROP = "drop"
    """Drop truncated members; the rest of the group trains (refused if none is left)."""


class RefusalReason(StrEnum):
    """Why a group was not trainable. Checks run in this order; the first failure is reported."""

    DUPLICATE = "duplicate"
    """The group, or one of its members, appears more than once."""
    FOREIGN_MEMBER = "foreign_member"
    """A member belongs to another task or group."""
    INCOMPLETE = "incomplete"
    """Members are missing, or some have not settled yet."""
    FAILED_MEMBER = "failed_member"
    """A member failed, was cancelled or was quarantined: its reward means nothing."""
    TRUNCATED = "truncated"
    """A member was truncated and the handling is `Truncated.REFUSE` (or all were dropped)."""
    NON_FINITE_REWARD = "non_finite_reward"
    """A member's reward is missing, NaN or infinite."""
    MIXED_POLICY = "mixed_policy"
    """A turn was sampled by a policy other than the group's."""
    STALE = "stale"
    """The group's policy is too many versions behind the current one (or ahead of it)."""
    MISALIGNED = "misaligned"
    """Tokens, masks and logprobs do not line up, so segments cannot be built, or a sampled
    token's logprob is not one a sampler could have produced (positive, non-finite, or below
    `MIN_LOGPROB`)."""
    EMPTY = "empty"
    """A member has no sampled token to train on."""


class Refusal(BaseModel):
    """One refused group, with the reason as a value and a detail for humans."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    group_id: str
    task_id: str
    reason: RefusalReason
    detail: str


class GroupSelection(BaseModel):
    """What `training_groups` returns: the groups to train on and the refused ones, in order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    trainable: list[Group] = Field(default_factory=list)
    refused: list[Refusal] = Field(default_factory=list)


def training_groups(
    groups: Iterable[Group],
    *,
    policy: PolicyRef,
    max_staleness: int,
    truncated: Truncated | str = Truncated.TRAIN,
    vocab_size: int | None = None,
) -> GroupSelection:
    """Check groups before training; return the trainable ones and why the others were refused.

    Args:
        groups: settled groups, e.g. from `RolloutDriver.groups()`.
        policy: the trainer's current policy; staleness is `policy.version - group.policy.version`.
        max_staleness: how many versions behind a group may be (0 = strictly on-policy).
        truncated: handling of members with `Status.TRUNCATED`.
        vocab_size: when given, token ids at or above it make a group misaligned.

    Returns:
        A `GroupSelection`. With `Truncated.DROP`, a trainable group may be a copy with fewer
        members (and `size` to match); the input groups are never modified.

    Raises:
        ConfigError: `max_staleness` is negative or `truncated` is not a known handling.
    """
    if max_staleness < 0:
        raise ConfigError(f"max_staleness must be >= 0, got {max_staleness}")
    try:
        handling = Truncated(truncated)
    except ValueError:
        known = ", ".join(t.value for t in Truncated)
        raise ConfigError(f"unknown truncated handling {truncated!r}; known: {known}") from None
    trainable: list[Group] = []
    refused: list[Refusal] = []
    seen: set[str] = set()
    for group in groups:
        if group.id in seen:
            reason, detail = RefusalReason.DUPLICATE, f"group {group.id} was passed twice"
            kept = group
        else:
            seen.add(group.id)
            reason, detail, kept = _check(group, policy, max_staleness, handling, vocab_size)
        if reason is None:
            trainable.append(kept)
        else:
            refused.append(
                Refusal(group_id=group.id, task_id=group.task_id, reason=reason, detail=detail)
            )
    return GroupSelection(trainable=trainable, refused=refused)


def _check(
    group: Group,
    policy: PolicyRef,
    max_staleness: int,
    handling: Truncated,
    vocab_size: int | None,
) -> tuple[RefusalReason | None, str, Group]:
    members = group.trajectories
    ids = Counter(t.id for t in members)
    dup = [i for i, n in ids.items() if n > 1]
    if dup:
        return RefusalReason.DUPLICATE, f"member {dup[0]} appears {ids[dup[0]]} times", group
    for t in members:
        if t.task_id != group.task_id or (t.group_id and t.group_id != group.id):
            return (
                RefusalReason.FOREIGN_MEMBER,
                f"member {t.id} has task {t.task_id!r} / group {t.group_id!r}, "
                f"not {group.task_id!r} / {group.id!r}",
                group,
            )
    if len(members) != group.size:
        return (
            RefusalReason.INCOMPLETE,
            f"{len(members)} of {group.size} admitted members present",
            group,
        )
    unsettled = [t.id for t in members if not t.settled]
    if unsettled:
        return (
            RefusalReason.INCOMPLETE,
            f"{len(unsettled)} member(s) not settled, first {unsettled[0]}",
            group,
        )
    for t in members:
        if t.status not in (Status.COMPLETED, Status.TRUNCATED):
            why = f": {t.error}" if t.error else ""
            return RefusalReason.FAILED_MEMBER, f"member {t.id} is {t.status.value}{why}", group
    cut = [t for t in members if t.status is Status.TRUNCATED]
    if cut and handling is Truncated.REFUSE:
        return RefusalReason.TRUNCATED, f"{len(cut)} member(s) truncated, first {cut[0].id}", group
    if cut and handling is Truncated.DROP:
        members = [t for t in members if t.status is not Status.TRUNCATED]
        if not members:
            return RefusalReason.TRUNCATED, "every member was truncated and dropped", group
        group = group.model_copy(update={"trajectories": members, "size": len(members)})
    for t in members:
        if t.reward is None or not math.isfinite(t.reward):
            return RefusalReason.NON_FINITE_REWARD, f"member {t.id} has reward {t.reward}", group
    for t in members:
        for k, turn in enumerate(t.turns):
            if turn.policy != group.policy:
                return (
                    RefusalReason.MIXED_POLICY,
                    f"member {t.id} turn {k} was sampled by {turn.policy.uri} "
                    f"(version {turn.policy.version}), the group by {group.policy.uri} "
                    f"(version {group.policy.version})",
                    group,
                )
    lag = policy.version - group.policy.version
    if lag > max_staleness or lag < 0:
        return (
            RefusalReason.STALE,
            f"group sampled by version {group.policy.version}, current is {policy.version}; "
            f"staleness {lag} outside [0, {max_staleness}]",
            group,
        )
    for t in members:
        detail = _alignment(t, vocab_size)
        if detail is not None:
            return RefusalReason.MISALIGNED, f"member {t.id}: {detail}", group
        if not any(len(turn.completion_ids) for turn in t.turns):
            return RefusalReason.EMPTY, f"member {t.id} has no sampled token", group
    return None, "", group


def _alignment(traj: Trajectory, vocab_size: int | None) -> str | None:
    """Why `traj`'s segments cannot be trained on, or None when they can."""
    try:
        segments = traj.segments()
    except (TrajectoryError, ValueError) as exc:
        return str(exc)
    for s, seg in enumerate(segments):
        if seg.mask and seg.mask[0]:
            return f"segment {s} starts with a sampled token, which nothing predicts"
        for i, (tok, m, lp) in enumerate(zip(seg.tokens, seg.mask, seg.logprobs, strict=True)):
            if tok < 0 or (vocab_size is not None and tok >= vocab_size):
                return f"segment {s} position {i}: token id {tok} outside the vocabulary"
            if m and lp > 1e-6:
                return f"segment {s} position {i}: logprob {lp} > 0 is not a log probability"
            if m and not lp >= MIN_LOGPROB:  # NaN fails too
                return (
                    f"segment {s} position {i}: sampler logprob {lp} is not finite or below "
                    f"{MIN_LOGPROB}; no sampler picks such a token"
                )
    return None
