"""Reward policies: what a member is worth when its episode did not end on the env's terms.

A harness reports how an episode ended (`Trajectory.status`, `info["stop_reason"]`); a
`RewardPolicy` says what that is worth. Every trajectory a harness settles as `completed` or
`truncated` carries a finite reward, so training never refuses a group for a missing one
(`training_groups`' `non_finite_reward`). A `failed` episode (an error of the system, not a
move of the model) keeps no reward, and training refuses its group.

Three situations, three frozen objects, each with a default under which a group trains:

- `IllFormedReward`: the model's output was unusable (no parse, no tool call, an unknown
  tool) and no correction message was configured. Default `DEFAULT_ILL_FORMED_REWARD`, -1.0.
- `TruncationReward`: a budget cut the episode off (turns, context tokens, a completion cut
  at `max_tokens`, wall clock). Default: what the tools paid, kept as it is.
- `UnpaidReward`: no tool paid anything (e.g. the episode was cut off before its first tool
  call, or an agent left without calling one). Default `DEFAULT_UNPAID_REWARD`, 0.0.

The first that applies decides, in that order. The env's own total stays on the trajectory as
`info["tool_reward"]` (None when no tool paid), so a script can always tell the two apart.

Example::

    # A game left unfinished, for whatever reason, is scored as lost:
    lost = -1.0
    rewards = RewardPolicy(
        truncated=TruncationReward(reward=lost),
        ill_formed=IllFormedReward(reward=lost),
        unpaid=UnpaidReward(reward=lost),
    )
    harness = ToolCallingHarness(renderer, client, sampling, rewards=rewards)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plies import ConfigError

__all__ = [
    "DEFAULT_ILL_FORMED_REWARD",
    "DEFAULT_REWARDS",
    "DEFAULT_UNPAID_REWARD",
    "IllFormedReward",
    "RewardPolicy",
    "TruncationReward",
    "UnpaidReward",
]

DEFAULT_ILL_FORMED_REWARD = -1.0
"""Below anything an env that pays 0 or more can give, and a loss in a +1 / 0 / -1 game."""
DEFAULT_UNPAID_REWARD = 0.0
"""Nothing earned: the tools paid nothing, so the episode is worth nothing."""


def _finite(name: str, value: float | None, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")


@dataclass(frozen=True, slots=True)
class IllFormedReward:
    """What a member gets when its output was unusable and the episode ended on it.

    Attributes:
        reward: replaces whatever the tools paid before the bad turn, so training penalises
            the format error itself.
    """

    reward: float = DEFAULT_ILL_FORMED_REWARD

    def __post_init__(self) -> None:
        _finite("IllFormedReward.reward", self.reward)


@dataclass(frozen=True, slots=True)
class UnpaidReward:
    """What a member gets when no tool paid anything (and no other policy applied).

    Attributes:
        reward: the episode's reward in place of the missing total.
    """

    reward: float = DEFAULT_UNPAID_REWARD

    def __post_init__(self) -> None:
        _finite("UnpaidReward.reward", self.reward)


@dataclass(frozen=True, slots=True)
class TruncationReward:
    """What a member gets when a budget cut its episode off (status `truncated`).

    With neither field set (the default), the member keeps what the tools paid, or
    `UnpaidReward` when they paid nothing.

    Attributes:
        reward: a flat reward that replaces whatever the tools paid: e.g. -1.0 scores a game
            left unfinished as lost. None: keep what they paid.
        at_most: cap what the tools paid at this, so that running into a budget never pays
            more than it (0.0: a truncated member may lose, never win, the way
            tinker-cookbook's `zero_reward_on_limit` clamps). None: no cap.

    Raises:
        ConfigError: a value is not finite, or both are set.
    """

    reward: float | None = None
    at_most: float | None = None

    def __post_init__(self) -> None:
        _finite("TruncationReward.reward", self.reward, optional=True)
        _finite("TruncationReward.at_most", self.at_most, optional=True)
        if self.reward is not None and self.at_most is not None:
            raise ConfigError(
                "TruncationReward takes reward (a flat value) or at_most (a cap), not both"
            )

    def score(self, paid: float | None, unpaid: UnpaidReward) -> float:
        """The reward of a truncated member whose tools paid `paid` (None: nothing)."""
        if self.reward is not None:
            return self.reward
        earned = paid if paid is not None else unpaid.reward
        return earned if self.at_most is None else min(earned, self.at_most)


@dataclass(frozen=True, slots=True)
class RewardPolicy:
    """The three policies a harness applies when it settles an episode.

    Attributes:
        truncated: for members cut off by a budget.
        ill_formed: for members whose output was unusable.
        unpaid: for members no tool paid.

    Raises:
        ConfigError: a field is not the policy object it names (e.g. a bare float).
    """

    truncated: TruncationReward = TruncationReward()
    ill_formed: IllFormedReward = IllFormedReward()
    unpaid: UnpaidReward = UnpaidReward()

    def __post_init__(self) -> None:
        for name, kind in (
            ("truncated", TruncationReward),
            ("ill_formed", IllFormedReward),
            ("unpaid", UnpaidReward),
        ):
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise ConfigError(
                    f"RewardPolicy.{name} must be a {kind.__name__}, got {value!r}; "
                    f"e.g. {name}={kind.__name__}(reward=-1.0)"
                )

    def score(self, paid: float | None, *, truncated: bool, ill_formed: bool = False) -> float:
        """The reward of an episode whose tools paid `paid` (None: nothing), by how it ended.

        Args:
            paid: the sum of the rewards the env's tools paid; None when none paid.
            truncated: a budget ended the episode.
            ill_formed: the model's unusable output ended the episode.
        """
        if ill_formed:
            return self.ill_formed.reward
        if truncated:
            return self.truncated.score(paid, self.unpaid)
        return paid if paid is not None else self.unpaid.reward


DEFAULT_REWARDS = RewardPolicy()
"""What a harness applies unless told otherwise: ill-formed -1.0, truncated keeps what the
tools paid, unpaid 0.0."""
