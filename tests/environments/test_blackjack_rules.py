"""Blackjack rules: exact agreement with gymnasium's Blackjack-v1, and the known expected returns.

Expected return per hand under gymnasium's `Blackjack-v1` rules (natural=False, sab=False):
always stand -0.186, hit below 17 -0.079, uniformly random hit/stand -0.396.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import gymnasium
import pytest

from plies.environments.blackjack import DECK, BlackjackGame, draw, total

HANDS = 20_000
TOLERANCE = 0.02

Policy = Callable[[int, bool, random.Random], bool]
"""(player total, usable ace, policy rng) -> hit?"""

POLICIES: dict[str, tuple[Policy, float]] = {
    "always_stand": (lambda t, a, r: False, -0.186),
    "hit_below_17": (lambda t, a, r: t < 17, -0.079),
    "uniform_random": (lambda t, a, r: r.random() < 0.5, -0.396),
}


def play_plies(seed: int, policy: Policy) -> tuple[float, list[tuple[int, int, bool]]]:
    game = BlackjackGame.deal(seed)
    rng = random.Random(f"policy:{seed}")
    seen = [(total(game.player), game.dealer[0], game.info()["usable_ace"])]
    while not game.done:
        game.hit() if policy(total(game.player), seen[-1][2], rng) else game.stand()
        seen.append((total(game.player), game.dealer[0], game.info()["usable_ace"]))
    return game.reward, seen


class _OurCards:
    """Stands in for gymnasium's numpy generator so both games see the same cards in order.

    Gymnasium draws every card with `np_random.choice(deck)`; its other `choice` calls only
    pick cosmetic suits and face names for rendering.
    """

    def __init__(self, seed: int):
        self.seed, self.index = seed, 0

    def choice(self, options):
        if tuple(options) != DECK:
            return options[0]
        card = draw(self.seed, self.index)
        self.index += 1
        return card


def play_gym(env, policy: Policy, rng: random.Random, *, seed: int | None = None):
    obs, _ = env.reset(seed=seed)
    seen = [(int(obs[0]), int(obs[1]), bool(obs[2]))]
    while True:
        obs, reward, terminated, truncated, _ = env.step(int(policy(seen[-1][0], seen[-1][2], rng)))
        seen.append((int(obs[0]), int(obs[1]), bool(obs[2])))
        if terminated or truncated:
            return float(reward), seen


@pytest.fixture
def gym_env():
    env = gymnasium.make("Blackjack-v1", natural=False, sab=False).unwrapped
    yield env
    env.close()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_same_cards_same_game_as_gymnasium(name, gym_env):
    """Dealt the same cards, gymnasium and plies agree on every observation and reward."""
    policy, _ = POLICIES[name]
    for seed in range(3_000):
        ours, our_seen = play_plies(seed, policy)
        gym_env.np_random = _OurCards(seed)
        theirs, their_seen = play_gym(gym_env, policy, random.Random(f"policy:{seed}"))
        assert (ours, our_seen) == (theirs, their_seen), f"seed {seed}"


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_expected_returns(name, gym_env):
    """20,000 seeded hands: plies and gymnasium's own generator both land on the exact value."""
    policy, expected = POLICIES[name]
    ours = sum(play_plies(seed, policy)[0] for seed in range(HANDS)) / HANDS
    rng = random.Random(0)
    gym_env.reset(seed=12345)
    theirs = sum(play_gym(gym_env, policy, rng)[0] for _ in range(HANDS)) / HANDS
    assert abs(ours - expected) < TOLERANCE, (name, ours)
    assert abs(theirs - expected) < TOLERANCE, (name, theirs)


def test_deal_is_reproducible_and_seed_dependent():
    a, b = BlackjackGame.deal(42), BlackjackGame.deal(42)
    assert a == b
    assert a.stand() == b.stand()
    deals = {tuple(BlackjackGame.deal(s).player + BlackjackGame.deal(s).dealer) for s in range(50)}
    assert len(deals) > 40


def test_card_frequencies_follow_an_infinite_deck():
    counts = {c: 0 for c in range(1, 11)}
    n = 26_000
    for i in range(n):
        counts[draw(7, i)] += 1
    for card, count in counts.items():
        expected = n * (4 if card == 10 else 1) / 13
        assert abs(count - expected) < 5 * expected**0.5, (card, count)


def test_game_state_round_trips_through_json():
    game = BlackjackGame.deal(5)
    resumed = BlackjackGame.from_json(game.to_json())
    assert resumed == game
    assert resumed.stand() == game.stand()
