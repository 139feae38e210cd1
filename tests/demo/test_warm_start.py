"""Who plays the warm start's transcripts: every call is checked against a replay of its deal."""

from __future__ import annotations

from collections import Counter

import pytest

from plies import PolicyRef
from plies.environments import BlackjackEnv, Task
from plies.recipes.blackjack.config import SEED_STRIDE, TEMPLATE_KWARGS, WARM_SEEDS
from plies.recipes.blackjack.warm_start import tool_call_ids, transcripts
from plies.tokens import ChatRenderer

pytestmark = pytest.mark.anyio

BASE = PolicyRef(uri="file:///base", version=0)
HANDS = 96


async def played(qwen3_tokenizer, players: str, seed: int = 0) -> list[list[tuple[int, str]]]:
    """Each transcript's calls with the total the player held at each, from a replayed deal
    (the run's `seed` shifts the deals by `SEED_STRIDE`)."""
    renderer = ChatRenderer(qwen3_tokenizer, template_kwargs=dict(TEMPLATE_KWARGS))
    data = await transcripts(
        renderer, qwen3_tokenizer, HANDS, policy=BASE, players=players, seed=seed
    )
    names = {tuple(tool_call_ids(qwen3_tokenizer, n)): n for n in ("hit", "stand")}
    hands = []
    for i, traj in enumerate(data):
        deal = WARM_SEEDS + seed * SEED_STRIDE + i
        async with BlackjackEnv() as env:
            info = (await env.reset(Task(id=f"replay-{i}", seed=deal))).info
            calls = []
            for turn in traj.turns:
                name = names[tuple(turn.completion_ids)]
                calls.append((info["player_total"], name))
                info = (await env.call_tool(name, {})).info
        hands.append(calls)
    return hands


async def test_threshold_players_hit_below_a_threshold_of_their_own(qwen3_tokenizer):
    hands = await played(qwen3_tokenizer, "thresholds")
    for calls in hands:
        hits = [t for t, name in calls if name == "hit"]
        stands = [t for t, name in calls if name == "stand"]
        # One threshold (12 to 21) per hand: every hit below it, the stand at or above it.
        assert len(stands) <= 1 and all(t >= 12 for t in stands), calls
        assert not stands or max(hits, default=0) < stands[0], calls
        assert all(name == "hit" for t, name in calls if t <= 11), calls
    # No threshold is favoured: at 14-16 some hands hit and some stand.
    middle = Counter(name for calls in hands for t, name in calls if 14 <= t <= 16)
    assert middle["hit"] >= 5 and middle["stand"] >= 5, middle


async def test_random_players_call_regardless_of_the_cards(qwen3_tokenizer):
    hands = await played(qwen3_tokenizer, "random")
    low = Counter(name for calls in hands for t, name in calls if t <= 11)
    high = Counter(name for calls in hands for t, name in calls if t >= 17)
    assert low["stand"] >= 5 and high["hit"] >= 5, (low, high)


async def test_another_run_seed_plays_other_deals_and_draws(qwen3_tokenizer):
    """Seed 7's transcripts replay on seed 7's deals, each hand as a threshold player plays
    it (on the wrong deals the totals would not fit the calls), and differ from seed 0's."""
    first, other = [await played(qwen3_tokenizer, "thresholds", seed) for seed in (0, 7)]
    for hand in other:
        fits = [t for t in range(12, 22) if all((n == "hit") == (tot < t) for tot, n in hand)]
        assert fits, hand
    assert first != other
