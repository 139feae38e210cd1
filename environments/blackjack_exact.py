"""Blackjack's exact values: the optimal strategy, what any policy is worth, and pricing.

The rules (`plies.environments.blackjack`: an infinite deck, the dealer stands on every 17,
no doubling or splitting) make the game a small Markov chain over the player's (total, soft)
state against the dealer's final-total distribution for each up card, so everything here is
a dynamic programme rather than a simulation:

- the strategy grid: what a policy does per (player total, dealer up card, soft), and the
  optimum (`optimal_hits`, `strategy_table`), the chart a learned policy is compared with;
- a policy's exact expected return per hand (`expected_return`, `policy_values`), with the
  figures `RANDOM_RETURN`, `ALWAYS_STAND_RETURN` and `OPTIMAL_RETURN` that the tests check
  against it;
- pricing a run's decision shares (`price`): a held-out evaluation of 2,000 hands at
  temperature 1 measures a policy to about +-0.04 (95%), and the deals themselves may be
  lucky (the optimal chart scores -0.035 on a recipe's first 2,000 against -0.047 exactly).
  The evaluation's decisions give, per cell, the share of hits, stands and forfeits (an
  ill-formed or cut-off call, scored `FORFEIT`); the programme prices those shares. The
  state is Markov, so a policy that looks at more of the conversation is worth exactly what
  its shares per cell, weighted by how often it reaches each history, are worth: the
  evaluation's own visits are that weighting. What is not exact is how well the hands
  measure the shares; the standard error says that (`Priced`). Beside it, the reference
  policies played on the same deals (`on_deals`) show a lucky deal set as references above
  their exact values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, NamedTuple

import numpy as np

from ._blackjack_game import DECK, BlackjackGame, total, usable_ace

__all__ = [
    "ALWAYS_STAND_RETURN",
    "CELLS",
    "FORFEIT",
    "HARD_TOTALS",
    "OPTIMAL_RETURN",
    "RANDOM_RETURN",
    "REFERENCES",
    "SOFT_TOTALS",
    "UP_CARDS",
    "Cell",
    "Decision",
    "Hand",
    "Priced",
    "difference",
    "expected_return",
    "hand_of",
    "on_deals",
    "optimal_hits",
    "optimal_return",
    "played_policy",
    "policy_values",
    "price",
    "price_record",
    "strategy_table",
]

RANDOM_RETURN = -0.396
ALWAYS_STAND_RETURN = -0.186
OPTIMAL_RETURN = -0.047
"""Exact expected returns per hand of a coin flip, of always standing and of the optimal
chart, rounded (`expected_return` computes them; docs/environments.md)."""

FORFEIT = -1.0
"""What a hand left unfinished (an ill-formed call, or out of tokens or turns) is worth:
scored as a loss, the value `expected_return` and `price` give a forfeit."""

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
    (`price`), and shares outside [0, 1] give that linear function's value there."""

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


CELLS: tuple[Cell, ...] = tuple(
    (player, up, soft)
    for soft, totals in ((False, HARD_TOTALS), (True, SOFT_TOTALS))
    for player in totals
    for up in UP_CARDS
)
"""Every cell a decision can be taken in: the states the dynamic programme asks about."""

Policy = Callable[[int, int, bool], float]

REFERENCES: Mapping[str, Policy] = {
    "random": lambda t, u, s: 0.5,
    "always_stand": lambda t, u, s: 0.0,
    "optimal": lambda t, u, s: float(optimal_hits(t, u, s)),
}
"""The policies a run is read against, as hit shares (summary.json's `references`)."""


@dataclass(frozen=True, slots=True)
class Priced:
    """A policy's exact expected return per hand at its measured shares, and how sure it is.

    The standard error is the delta method's: the value is linear in each cell's shares, and its
    derivatives (the programme's, nudging one cell at a time) times each cell's share
    variance give the value's. A cell's variance is taken at its shares with half a hit and
    half a stand added (so a cell that went one way every time in a few visits still counts
    as unsure, and one never visited as anything from stand to hit), over its visits plus
    one. Two policies' evaluations are independent draws given the cells visited, so their
    difference's variance is the sum (`difference`).
    """

    value: float
    stderr: float
    decisions: int
    """Decisions (and forfeits) measured."""


def price(decisions: Iterable[Sequence[Any]], forfeits: Iterable[Sequence[Any]] = ()) -> Priced:
    """Price the shares of `decisions` ((total, up, soft, hit)) and `forfeits` ((total, up,
    soft): a hand left unfinished there) per cell; a cell never met is a coin flip."""
    counts = {cell: [0, 0, 0] for cell in CELLS}  # hits, stands, forfeits
    for player, up, soft, hit in decisions:
        counts[(player, up, bool(soft))][0 if hit else 1] += 1
    for player, up, soft in forfeits:
        counts[(player, up, bool(soft))][2] += 1
    index = {cell: i for i, cell in enumerate(CELLS)}
    n = np.array([sum(counts[c]) for c in CELLS], dtype=float)
    hits = np.array([counts[c][0] for c in CELLS], dtype=float)
    lost = np.array([counts[c][2] for c in CELLS], dtype=float)
    seen = n > 0
    hit = np.where(seen, hits / np.maximum(n, 1), 0.5)
    forfeit = np.where(seen, lost / np.maximum(n, 1), 0.0)
    # Columns: the measured shares, then each cell's hit share nudged, then its forfeit share.
    k = len(CELLS)
    step = np.eye(k)
    hit_cols = np.concatenate([hit[:, None], hit[:, None] + step, np.repeat(hit[:, None], k, 1)], 1)
    lost_cols = np.concatenate(
        [forfeit[:, None], np.repeat(forfeit[:, None], k, 1), forfeit[:, None] + step], 1
    )
    values = policy_values(
        lambda t, u, s: hit_cols[index[(t, u, s)]], lambda t, u, s: lost_cols[index[(t, u, s)]]
    )
    base = float(values[0])
    d_hit, d_lost = values[1 : k + 1] - base, values[k + 1 :] - base
    # Each cell's share covariance, at half a hit and half a stand more, over visits + 1.
    p_hit, p_lost = (hits + 0.5) / (n + 1), lost / (n + 1)
    var = (
        d_hit**2 * p_hit * (1 - p_hit)
        + d_lost**2 * p_lost * (1 - p_lost)
        - 2 * d_hit * d_lost * p_hit * p_lost
    ) / (n + 1)
    return Priced(base, math.sqrt(float(var.sum())), int(n.sum()))


def price_record(record: Mapping[str, Any]) -> Priced:
    """`price` of an evaluation as the run log holds it (a record from before forfeits were
    logged prices its decisions alone)."""
    return price(record.get("decisions", ()), record.get("forfeits", ()))


def difference(after: Priced, before: Priced) -> Priced:
    """`after` - `before`, e.g. GRPO's improvement on its warm start, priced exactly."""
    stderr = math.hypot(after.stderr, before.stderr)
    return Priced(after.value - before.value, stderr, after.decisions + before.decisions)


def on_deals(hit_share: Policy, seeds: Iterable[int]) -> float:
    """The mean expected reward of `hit_share` on the deals of `seeds`: on each, the cards
    are fixed, so the chance of each way the hand can go is the product of the
    policy's calls, summed exactly (a deterministic policy plays the deal out once)."""
    rewards = []
    for seed in seeds:
        reach, expected, hits = 1.0, 0.0, 0
        while reach > 0.0:
            game = BlackjackGame.deal(seed)
            for _ in range(hits):
                game.hit()
            if game.done:  # busted on the last hit
                expected += reach * game.reward
                break
            p = hit_share(total(game.player), game.dealer[0], usable_ace(game.player))
            if p < 1.0:
                game.stand()
                expected += reach * (1.0 - p) * game.reward
            reach *= p
            hits += 1
        rewards.append(expected)
    return sum(rewards) / len(rewards) if rewards else float("nan")
