"""Reward selection: what a hand the model left unfinished is worth, and the harness to apply it."""

from __future__ import annotations

from plies.environments.blackjack_exact import FORFEIT
from plies.harness import (
    EpisodeLimits,
    IllFormedReward,
    RewardPolicy,
    ToolCallingHarness,
    TruncationReward,
    UnpaidReward,
)
from plies.policy import PolicyClient, SamplingParams
from plies.tokens import ChatRenderer

from .config import SYSTEM_PROMPT, Budget

__all__ = ["FORFEIT_REWARDS", "harness_for_budget", "sampling_for_budget"]

FORFEIT_REWARDS = RewardPolicy(
    truncated=TruncationReward(reward=FORFEIT),
    ill_formed=IllFormedReward(reward=FORFEIT),
    unpaid=UnpaidReward(reward=FORFEIT),
)
"""The harness's reward policy for Blackjack: every way of leaving a hand unfinished loses it
(`FORFEIT`), so evaluation counts it, GRPO learns to avoid it, and `price` prices it.

A truncated hand is scored flat rather than by what the tools paid (a hit that did not bust
pays 0), so running out of turns is never better than standing."""


def sampling_for_budget(budget: Budget) -> SamplingParams:
    """How every turn of a run is sampled: temperature 1 and the budget's `top_p` (GRPO's
    batches say both, so the trainer's logprobs match the sampler's), within the budget's
    tokens. `run.json` records it, so `plies replay` re-samples with exactly this."""
    return SamplingParams(max_tokens=budget.max_new_tokens, temperature=1.0, top_p=budget.top_p)


def harness_for_budget(
    renderer: ChatRenderer, policy: PolicyClient, budget: Budget
) -> ToolCallingHarness:
    """The recipe's harness: one tool call a turn, sampled by `sampling_for_budget`, within
    the budget's turns, scored by `FORFEIT_REWARDS`."""
    return ToolCallingHarness(
        renderer,
        policy,
        sampling_for_budget(budget),
        limits=EpisodeLimits(max_turns=budget.max_turns),
        system_prompt=SYSTEM_PROMPT,
        rewards=FORFEIT_REWARDS,
    )
