"""Reward policies: each situation's default, what overrides it, and refusals of bad values."""

from __future__ import annotations

import math

import pytest

from plies import ConfigError
from plies.harness import IllFormedReward, RewardPolicy, TruncationReward, UnpaidReward
from plies.harness.rewards import DEFAULT_ILL_FORMED_REWARD, DEFAULT_REWARDS, DEFAULT_UNPAID_REWARD


def test_defaults_give_every_ending_a_finite_reward():
    assert RewardPolicy() == DEFAULT_REWARDS
    score = DEFAULT_REWARDS.score
    assert score(0.5, truncated=False) == 0.5  # the env said done: what the tools paid
    assert score(None, truncated=False) == DEFAULT_UNPAID_REWARD == 0.0
    assert score(0.5, truncated=True) == 0.5  # truncated: kept as paid
    assert score(None, truncated=True) == DEFAULT_UNPAID_REWARD
    assert score(0.5, truncated=False, ill_formed=True) == DEFAULT_ILL_FORMED_REWARD == -1.0
    assert score(None, truncated=True, ill_formed=True) == DEFAULT_ILL_FORMED_REWARD


def test_each_policy_overrides_only_its_own_situation():
    policy = RewardPolicy(
        truncated=TruncationReward(reward=-2.0),
        ill_formed=IllFormedReward(reward=-3.0),
        unpaid=UnpaidReward(reward=-0.5),
    )
    assert policy.score(0.75, truncated=False) == 0.75
    assert policy.score(None, truncated=False) == -0.5
    assert policy.score(0.75, truncated=True) == -2.0  # flat: replaces what was paid
    assert policy.score(None, truncated=True) == -2.0
    assert policy.score(0.75, truncated=False, ill_formed=True) == -3.0  # ill-formed first


def test_a_cap_keeps_losses_and_removes_gains_of_truncated_members():
    capped = RewardPolicy(truncated=TruncationReward(at_most=0.0), unpaid=UnpaidReward(0.25))
    assert capped.score(1.0, truncated=True) == 0.0
    assert capped.score(-0.5, truncated=True) == -0.5
    assert capped.score(None, truncated=True) == 0.0  # unpaid 0.25, capped
    assert capped.score(1.0, truncated=False) == 1.0  # a finished episode is not capped


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "1", True, None])
def test_non_finite_or_non_numeric_rewards_are_refused(bad):
    for make in (IllFormedReward, UnpaidReward):
        with pytest.raises(ConfigError, match="must be a finite number"):
            make(reward=bad)
    if bad is not None:
        with pytest.raises(ConfigError, match="must be a finite number"):
            TruncationReward(reward=bad)
        with pytest.raises(ConfigError, match="must be a finite number"):
            TruncationReward(at_most=bad)


def test_misconfigured_policies_say_what_to_write():
    with pytest.raises(ConfigError, match="not both"):
        TruncationReward(reward=-1.0, at_most=0.0)
    with pytest.raises(ConfigError, match=r"RewardPolicy.truncated must be a TruncationReward"):
        RewardPolicy(truncated=-1.0)
    with pytest.raises(ConfigError, match=r"unpaid=UnpaidReward\(reward=-1.0\)"):
        RewardPolicy(unpaid=0.0)


def test_policies_are_frozen_values():
    policy = RewardPolicy(ill_formed=IllFormedReward(-0.5))
    assert policy == RewardPolicy(ill_formed=IllFormedReward(-0.5))
    assert hash(policy) == hash(RewardPolicy(ill_formed=IllFormedReward(-0.5)))
    with pytest.raises(AttributeError):
        policy.ill_formed = IllFormedReward(-2.0)  # type: ignore[misc]
