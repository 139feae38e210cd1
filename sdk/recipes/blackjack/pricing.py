"""What a run's policy is worth, exactly, and what its held-out deals were worth to others.

A held-out evaluation of 2,000 hands at temperature 1 measures a policy to about +-0.04 (95%),
and the deals themselves may be lucky: the optimal chart scores -0.035 on the recipe's first
2,000 against -0.047 exactly. So a run is judged on two figures:

- *priced exactly* (`price`): the evaluation's decisions give, per (total, up card, soft)
  cell, the share of hits, stands and forfeits (an ill-formed or cut-off call, scored -1);
  `strategy.expected_return`'s dynamic programme prices those shares. The state is Markov
  (an infinite deck: the total, the ace and the up card are all the future depends on), so
  a policy that looks at more of the conversation is worth exactly what its shares per cell,
  weighted by how often it reaches each history, are worth: the evaluation's own visits
  are that weighting. What is not exact is how well 2,000 hands measure the shares; the
  interval says that (`Priced`).
- *sampled* (the evaluation's mean return), beside the reference policies played on the
  same deals (`on_deals`), so a lucky deal set shows as references above their exact values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from plies.environments.blackjack import BlackjackGame, total, usable_ace

from .config import EVAL_SEEDS
from .evaluation import Z95
from .strategy import HARD_TOTALS, SOFT_TOTALS, UP_CARDS, Cell, optimal_hits, policy_values

__all__ = ["REFERENCES", "Priced", "difference", "on_deals", "price", "price_record"]

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

    The interval is the delta method's: the value is linear in each cell's shares, and its
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

    @property
    def ci95(self) -> list[float]:
        return [self.value - Z95 * self.stderr, self.value + Z95 * self.stderr]


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


def on_deals(hit_share: Policy, hands: Iterable[int]) -> float:
    """The mean expected reward of `hit_share` on held-out deals `hands` (indices): on each,
    the cards are fixed, so the chance of each way the hand can go is the product of the
    policy's calls, summed exactly (a deterministic policy plays the deal out once)."""
    rewards = []
    for i in hands:
        seed, reach, expected, hits = EVAL_SEEDS + i, 1.0, 0.0, 0
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
