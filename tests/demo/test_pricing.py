"""A run's headline: its policy priced exactly (`blackjack_exact.price`), and the deals' own luck.

The dynamic programme is checked against a brute-force enumeration of the actual hands, built
on the game's own `total` and `usable_ace` rather than the programme's (total, soft) states;
the interval against the real game; and an evaluation's forfeits against a scripted policy
played through the real harness and env.
"""

from __future__ import annotations

import random
from functools import cache

import anyio
import pytest

from plies.environments import BlackjackEnv
from plies.environments.blackjack import DECK, BlackjackGame, total, usable_ace
from plies.environments.blackjack_exact import (
    ALWAYS_STAND_RETURN,
    CELLS,
    OPTIMAL_RETURN,
    RANDOM_RETURN,
    REFERENCES,
    difference,
    expected_return,
    on_deals,
    optimal_hits,
    price,
)
from plies.recipes.blackjack import BUDGETS
from plies.recipes.blackjack.config import EVAL_SEEDS, TEMPLATE_KWARGS
from plies.recipes.blackjack.evaluation import held_out, tally
from plies.recipes.blackjack.rewards import harness_for_budget
from plies.rl import ci95, mean_stderr, play_tasks
from plies.runtime import EnvPool, Interrupts, RolloutResources
from plies.testing import ScriptedPolicy
from plies.tokens import ChatRenderer

P = {card: DECK.count(card) / len(DECK) for card in set(DECK)}


def _enumerated(hit_share, forfeit_share=lambda t, u, s: 0.0) -> float:
    """The expected return per hand by enumerating every player and dealer hand as a list of
    cards (multisets, memoised), scored as `BlackjackGame.stand` scores them."""

    @cache
    def dealer(cards: tuple[int, ...]) -> tuple[tuple[int, float], ...]:
        if total(list(cards)) >= 17:
            return ((total(list(cards)), 1.0),)
        out: dict[int, float] = {}
        for card, p in P.items():
            for final, q in dealer(tuple(sorted((*cards, card)))):
                out[final] = out.get(final, 0.0) + p * q
        return tuple(out.items())

    def stand(player: int, up: int) -> float:
        value = 0.0
        for hole, p in P.items():
            for final, q in dealer(tuple(sorted((up, hole)))):
                score = 0 if final > 21 else final
                value += p * q * ((player > score) - (player < score))
        return value

    @cache
    def hand(cards: tuple[int, ...], up: int) -> float:
        player = total(list(cards))
        if player > 21:
            return -1.0
        soft = usable_ace(list(cards))
        p, f = hit_share(player, up, soft), forfeit_share(player, up, soft)
        value = (1 - p - f) * stand(player, up) - f
        if p:
            value += p * sum(q * hand(tuple(sorted((*cards, c))), up) for c, q in P.items())
        return value

    return sum(
        pu * pa * pb * hand(tuple(sorted((a, b))), up)
        for up, pu in P.items()
        for a, pa in P.items()
        for b, pb in P.items()
    )


def _noisy_optimal(t: int, u: int, s: bool) -> float:
    return 0.85 if optimal_hits(t, u, s) else 0.1


def _forfeit(t: int, u: int, s: bool) -> float:
    return 0.05 if t >= 15 else 0.01


def test_the_programme_prices_every_policy_as_enumerating_the_hands_does():
    for name, policy in REFERENCES.items():
        assert expected_return(policy) == pytest.approx(_enumerated(policy), abs=1e-12), name
    assert expected_return(_noisy_optimal, _forfeit) == pytest.approx(
        _enumerated(_noisy_optimal, _forfeit), abs=1e-12
    )
    # ...and the enumeration gives the references the docs quote.
    assert _enumerated(REFERENCES["random"]) == pytest.approx(RANDOM_RETURN, abs=5e-4)
    assert _enumerated(REFERENCES["always_stand"]) == pytest.approx(ALWAYS_STAND_RETURN, abs=5e-4)
    assert _enumerated(REFERENCES["optimal"]) == pytest.approx(OPTIMAL_RETURN, abs=5e-4)
    with pytest.raises(ValueError, match="not a probability"):
        expected_return(lambda t, u, s: 0.99, lambda t, u, s: 0.02)


def _played(seed: int, hands: int) -> tuple[list, list, list[float]]:
    """`_noisy_optimal` with `_forfeit` on the real game: its decisions, forfeits, rewards."""
    rng, decisions, forfeits, rewards = random.Random(seed), [], [], []
    for i in range(hands):
        game = BlackjackGame.deal(seed * 1_000_000 + i)
        while not game.done:
            cell = (total(game.player), game.dealer[0], usable_ace(game.player))
            draw = rng.random()
            if draw < _forfeit(*cell):
                forfeits.append(cell)
                game.done, game.reward = True, -1.0
            elif draw < _forfeit(*cell) + _noisy_optimal(*cell):
                decisions.append((*cell, True))
                game.hit()
            else:
                decisions.append((*cell, False))
                game.stand()
        rewards.append(game.reward)
    return decisions, forfeits, rewards


def test_an_evaluations_shares_priced_hold_the_exact_value_and_are_sharper_than_its_mean():
    exact = expected_return(_noisy_optimal, _forfeit)
    for seed in (1, 2):
        decisions, forfeits, rewards = _played(seed, 2000)
        priced = price(decisions, forfeits)
        low, high = ci95(priced.value, priced.stderr)
        assert low < exact < high, (seed, low, exact, high)
        assert priced.decisions == len(decisions) + len(forfeits)
        # The sampled mean of the same hands: an interval more than twice as wide.
        assert high - low < (2 * 1.96 * mean_stderr(rewards)[1]) / 2
    # The forfeits count: priced without them, the same hands are worth more than they are.
    assert price(decisions, ()).value > high


def test_a_chart_played_everywhere_prices_at_its_value_with_no_doubt_left():
    chart = [(*cell, optimal_hits(*cell)) for cell in CELLS for _ in range(400)]
    priced = price(chart)
    assert priced.value == pytest.approx(expected_return(REFERENCES["optimal"]), abs=1e-12)
    # Half a hit and half a stand more per cell: unsure, by a little, after 400 visits each.
    assert 0 < priced.stderr < 0.005
    # A cell never visited is a coin flip, and as unsure as one.
    assert price([]).value == pytest.approx(expected_return(REFERENCES["random"]), abs=1e-12)
    assert price([]).stderr > 10 * priced.stderr


def test_the_improvement_is_the_difference_with_both_uncertainties():
    before, after = price(*_played(3, 500)[:2]), price(*_played(4, 500)[:2])
    gain = difference(after, before)
    assert gain.value == pytest.approx(after.value - before.value)
    assert gain.stderr == pytest.approx((after.stderr**2 + before.stderr**2) ** 0.5)


def test_the_references_on_the_held_out_deals_are_what_those_deals_pay_them():
    seeds = range(EVAL_SEEDS, EVAL_SEEDS + 300)
    for name in ("optimal", "always_stand"):  # deterministic: each deal played out once
        rewards = []
        for seed in seeds:
            game = BlackjackGame.deal(seed)
            while not game.done:
                hit = REFERENCES[name](total(game.player), game.dealer[0], usable_ace(game.player))
                game.hit() if hit else game.stand()
            rewards.append(game.reward)
        assert on_deals(REFERENCES[name], seeds) == pytest.approx(sum(rewards) / len(rewards))
    # The coin's expectation on each deal, against coins flipped on the same deals.
    rng, rewards = random.Random(5), []
    for _ in range(40):
        for seed in seeds:
            game = BlackjackGame.deal(seed)
            while not game.done:
                game.hit() if rng.random() < 0.5 else game.stand()
            rewards.append(game.reward)
    mean, stderr = mean_stderr(rewards)
    assert abs(on_deals(REFERENCES["random"], seeds) - mean) < 4 * stderr


@pytest.mark.anyio
async def test_an_evaluation_records_where_each_hand_was_forfeit(qwen3_tokenizer):
    """A scripted player that hits once, then answers in words (ill-formed): each hand that
    did not bust is forfeit at its total after one card more, as the deal says."""
    hit = {"tool_calls": [{"name": "hit", "arguments": {}}]}
    policy = ScriptedPolicy(qwen3_tokenizer, [hit, "I would rather not say."])
    renderer = ChatRenderer(qwen3_tokenizer, template_kwargs=dict(TEMPLATE_KWARGS))
    harness = harness_for_budget(renderer, policy, BUDGETS["smoke"])

    async def env() -> BlackjackEnv:
        return BlackjackEnv()

    hands = 24
    async with RolloutResources(sampler=policy, pools=[EnvPool(env, limit=8)]) as resources:
        with anyio.fail_after(120):
            played = await play_tasks(
                resources, harness.play, policy.policy, held_out(hands), concurrency=8,
                interrupts=Interrupts(),
            )  # fmt: skip
    result = tally(played)
    expected = []
    for i in range(hands):
        game = BlackjackGame.deal(EVAL_SEEDS + i)
        game.hit()
        if not game.done:
            expected.append((total(game.player), game.dealer[0], usable_ace(game.player)))
    assert expected and sorted(map(tuple, result["forfeits"])) == sorted(expected)
    assert result["ill_formed"] == len(expected) and len(result["decisions"]) == hands
    assert all(hit for *_, hit in result["decisions"])
