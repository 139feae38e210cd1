"""The strategy grid: what a policy does per (player total, dealer up card, soft), and the optimum.

The optimum is exact for plies' rules (an infinite deck, the dealer stands on every 17, no
doubling or splitting): a small dynamic programme over the player's (total, soft) state
against the dealer's final-total distribution for each up card. It is the grid a person
compares a learned policy with, and the source of `OPTIMAL_RETURN`'s check in the tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import cache
from typing import Any, NamedTuple

import numpy as np

from plies.environments.blackjack import DECK, BlackjackGame, total, usable_ace

from .rewards import FORFEIT

__all__ = [
    "HARD_TOTALS",
    "SOFT_TOTALS",
    "UP_CARDS",
    "Cell",
    "Decision",
    "Hand",
    "expected_return",
    "hand_of",
    "optimal_hits",
    "optimal_return",
    "played_policy",
    "policy_values",
    "strategy_table",
]

UP_CARDS = tuple(range(1, 11))
"""Dealer up cards, the ace as 1 (the grid's columns)."""
HARD_TOTALS = tuple(range(4, 22))
SOFT_TOTALS = tuple(range(12, 22))
"""Player totals the grid shows (its rows): hard 4-21, soft (a usable ace) 12-21."""

Cell = tuple[int, int, bool]
"""A state a decision is taken in: (player total, dealer up card, soft)."""
Decision = tuple[int, int, bool, bool]
"""One decision seen: (player total, dealer up card, soft, hit)."""

_P = {card: DECK.count(card) / len(DECK) for card in set(DECK)}


def _add(state: tuple[int, bool], card: int) -> tuple[int, bool]:
    """The (total, soft) after drawing `card` onto a hand of (total, soft)."""
    value, soft = state
    value += card
    if card == 1 and value + 10 <= 21:
        return value + 10, True
    if value > 21 and soft:
        return value - 10, False
    return value, soft


@cache
def _dealer(state: tuple[int, bool]) -> dict[int, float]:
    """Distribution of the dealer's final total (22 for a bust) from (total, soft)."""
    value, _ = state
    if value > 21:
        return {22: 1.0}
    if value >= 17:
        return {value: 1.0}
    out: dict[int, float] = {}
    for card, p in _P.items():
        for final, q in _dealer(_add(state, card)).items():
            out[final] = out.get(final, 0.0) + p * q
    return out


@cache
def _dealer_from_up(up: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for hole, p in _P.items():
        for final, q in _dealer(_add(_add((0, False), up), hole)).items():
            out[final] = out.get(final, 0.0) + p * q
    return out


def _stand_value(player: int, up: int) -> float:
    return sum(
        q * ((final > 21 or player > final) - (final <= 21 and player < final))
        for final, q in _dealer_from_up(up).items()
    )


@cache
def _values(state: tuple[int, bool], up: int) -> tuple[float, float]:
    """(value of standing, value of hitting) from (total, soft) against `up`."""
    hit = 0.0
    for card, p in _P.items():
        after = _add(state, card)
        hit += p * (-1.0 if after[0] > 21 else max(_values(after, up)))
    return _stand_value(state[0], up), hit


def optimal_hits(player: int, up: int, soft: bool) -> bool:
    """Whether the optimal policy hits on `player` (soft: a usable ace) against `up`."""
    stand, hit = _values((player, soft), up)
    return hit > stand


def optimal_return() -> float:
    """The optimal policy's expected return per hand, over all deals."""
    return expected_return(lambda player, up, soft: float(optimal_hits(player, up, soft)))


def expected_return(
    hit_share: Callable[[int, int, bool], float],
    forfeit_share: Callable[[int, int, bool], float] | None = None,
) -> float:
    """The exact expected return per hand of a policy that hits with probability
    `hit_share(total, up, soft)`, forfeits the hand (an ill-formed or cut-off call: -1) with
    probability `forfeit_share(...)` (None: never) and stands otherwise: a dynamic programme
    over (total, soft) against the dealer's final-total distribution, `optimal_return` being
    the optimal chart's case.

    It prices what sampling costs: a policy that plays the optimal call 95% of the time
    loses about as much to its 5% as separates "hit below 17" from the optimum
    (docs/research.md).

    Raises:
        ValueError: a share outside [0, 1], or hit and forfeit shares summing above 1.
    """

    def checked(share: Callable[[int, int, bool], float]) -> Callable[[int, int, bool], float]:
        def at(player: int, up: int, soft: bool) -> float:
            p = share(player, up, soft)
            f = 0.0 if forfeit_share is None else forfeit_share(player, up, soft)
            if not (0.0 <= p <= 1.0 and 0.0 <= f <= 1.0 - p):
                raise ValueError(
                    f"hit share {p}, forfeit share {f} at {player} ({'soft' if soft else 'hard'})"
                    f" against {up}: not a probability"
                )
            return p

        return at

    return float(policy_values(checked(hit_share), forfeit_share))


def policy_values(
    hit_share: Callable[[int, int, bool], Any],
    forfeit_share: Callable[[int, int, bool], Any] | None,
) -> Any:
    """`expected_return` of many policies at once, unchecked: each share a float or an array
    (one policy per element), the value the same shape. The value is linear in each cell's
    shares, so an array of shares nudged one cell at a time gives its exact derivatives
    (`pricing`), and shares outside [0, 1] give that linear function's value there."""

    @cache
    def value(state: tuple[int, bool], up: int) -> Any:
        if state[0] > 21:
            return -1.0
        p = hit_share(state[0], up, state[1])
        f = 0.0 if forfeit_share is None else forfeit_share(state[0], up, state[1])
        out = (1.0 - p - f) * _stand_value(state[0], up) + f * FORFEIT
        if np.any(p):  # a state the policy never hits from leads nowhere
            out = out + p * sum(q * value(_add(state, card), up) for card, q in _P.items())
        return out

    return sum(
        pu * pa * pb * value(_add(_add((0, False), a), b), up)
        for up, pu in _P.items()
        for a, pa in _P.items()
        for b, pb in _P.items()
    )


def played_policy(
    decisions: Iterable[tuple[int, int, bool, float]],
) -> Callable[[int, int, bool], float]:
    """The hit share in each (total, up card, soft) cell of `decisions`, as a policy for
    `expected_return`: what a run's evaluation played, priced exactly. The last item of a
    decision is its hit (True / False) or its chance of hitting; a cell never met (a rare
    one) is taken as a coin flip."""
    cells: dict[tuple[int, int, bool], list[float]] = {}
    for player, up, soft, hit in decisions:
        cell = cells.setdefault((player, up, bool(soft)), [0.0, 0.0])
        cell[0] += float(hit)
        cell[1] += 1.0
    share = {key: hits / n for key, (hits, n) in cells.items()}
    return lambda player, up, soft: share.get((player, up, soft), 0.5)


class Hand(NamedTuple):
    """What one evaluated hand tells the pricing (`hand_of`)."""

    decisions: list[Decision]
    forfeit: Cell | None
    """Where the hand was left unfinished (an ill-formed call, or a budget ran out), or None:
    the env ended it (a stand, a bust)."""


def hand_of(trajectory: Any, seed: int) -> Hand:
    """The decisions of one evaluated hand of deal `seed`, and where it was forfeit.

    The deal fixes the cards (every variant of the env deals from the same seeds), so
    decision k was taken holding the deal's cards after k hits: rebuilt from the seed and the
    calls, since the harness reports the env's cards only for a hand the env ended. A call
    other than one hit or stand (an ill-formed turn) ends the list: the hand was forfeit there.
    """
    game = BlackjackGame.deal(seed)
    out: list[Decision] = []
    for turn in trajectory.turns:
        calls = (turn.message or {}).get("tool_calls") or []
        names = [c["function"]["name"] for c in calls]
        if len(names) != 1 or names[0] not in ("hit", "stand") or game.done:
            break
        out.append((total(game.player), game.dealer[0], usable_ace(game.player), names[0] == "hit"))
        if names[0] == "stand":
            return Hand(out, None)
        game.hit()
    if trajectory.info.get("stop_reason") == "done" or game.done:
        return Hand(out, None)
    return Hand(out, (total(game.player), game.dealer[0], usable_ace(game.player)))


def strategy_table(decisions: Iterable[Decision]) -> dict[str, Any]:
    """The grid as JSON: per soft/hard, total and up card, the hit share, decisions and optimum.

    Keys are strings ("hard" / "soft", then the total, then the up card with "A" for 1) so the
    table reads the way the classic chart does; a cell never visited has `hit_rate` None.
    """
    counts: dict[tuple[int, int, bool], list[int]] = {}
    for player, up, soft, hit in decisions:
        cell = counts.setdefault((player, up, soft), [0, 0])
        cell[0] += hit
        cell[1] += 1
    table: dict[str, Any] = {}
    for soft, totals in ((False, HARD_TOTALS), (True, SOFT_TOTALS)):
        rows: dict[str, Any] = {}
        for player in totals:
            row = {}
            for up in UP_CARDS:
                hits, n = counts.get((player, up, soft), (0, 0))
                row["A" if up == 1 else str(up)] = {
                    "hit_rate": round(hits / n, 3) if n else None,
                    "decisions": n,
                    "optimal": "hit" if optimal_hits(player, up, soft) else "stand",
                }
            rows[str(player)] = row
        table["soft" if soft else "hard"] = rows
    return table
