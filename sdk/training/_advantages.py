"""GRPO advantages and training batches built from checked groups.

Advantages stay explicit in the script: `grpo_advantages` is a small, documented default
(group-mean baseline, optional std scaling), and `training_batch` takes whatever advantages
the caller computed, so other estimators need no change here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .._exceptions import ConfigError
from ..trajectory import Group
from ..wire.training import Datum, TrainingBatch

__all__ = ["grpo_advantages", "training_batch"]


def grpo_advantages(
    rewards_G: Sequence[float], *, scale_std: bool = False, eps: float = 1e-6
) -> list[float]:
    """Each reward minus the group mean, optionally divided by the group's std.

    The std is the population std (ddof 0), so a group of one gets advantage 0 rather than
    NaN; `eps` keeps a group of equal rewards at exactly 0.

    Raises:
        ConfigError: the group is empty or a reward is not finite.
    """
    if not rewards_G:
        raise ConfigError("cannot compute advantages of an empty group")
    bad = [r for r in rewards_G if r is None or not math.isfinite(r)]
    if bad:
        raise ConfigError(f"rewards must be finite numbers, got {bad[0]}")
    mean = sum(rewards_G) / len(rewards_G)
    adv_G = [r - mean for r in rewards_G]
    if scale_std:
        std = math.sqrt(sum(a * a for a in adv_G) / len(adv_G))
        adv_G = [a / (std + eps) for a in adv_G]
    return adv_G


def training_batch(
    groups: Sequence[Group],
    advantages_G: Sequence[Sequence[float]],
    *,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = -1,
    skip_zero: bool = False,
) -> TrainingBatch:
    """One datum per segment, with its member's advantage on every sampled token.

    Args:
        groups: trainable groups (from `training_groups`).
        advantages_G: for each group, one advantage per member, in member order.
        temperature, top_p, top_k: how the members were sampled, so that the trainer takes
            each token's logprob from the distribution the sampler drew it from.
        skip_zero: leave out members whose advantage is exactly 0. They add no gradient to
            the importance-sampling and PPO losses but still count in the per-token mean, so
            skipping them changes the loss scale; it saves their compute.

    Raises:
        ConfigError: advantages do not match the groups, or nothing is left to train on.
    """
    if len(advantages_G) != len(groups):
        raise ConfigError(f"{len(advantages_G)} advantage lists for {len(groups)} groups")
    data: list[Datum] = []
    for group, adv_G in zip(groups, advantages_G, strict=True):
        if len(adv_G) != len(group.trajectories):
            raise ConfigError(
                f"group {group.id}: {len(adv_G)} advantages for {len(group.trajectories)} members"
            )
        for traj, adv in zip(group.trajectories, adv_G, strict=True):
            if not math.isfinite(adv):
                raise ConfigError(f"group {group.id} member {traj.id}: advantage {adv}")
            if skip_zero and adv == 0.0:
                continue
            data.extend(Datum.from_segment(seg, adv) for seg in traj.segments() if any(seg.mask))
    if not data:
        raise ConfigError("no datum to train on (every advantage was zero or no token sampled)")
    return TrainingBatch(data=data, temperature=temperature, top_p=top_p, top_k=top_k)
