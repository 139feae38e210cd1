"""What a Blackjack policy is worth, exactly: the prices docs/training.md quotes.

The flagship target (-0.08 on held-out hands, sampled at temperature 1) is a statement about
a stochastic policy. This prints the exact expected return per hand of the reference
policies and of their noisy versions, side by side, so the target can be read against what
a policy's leftover randomness costs. No sampling: `strategy.expected_return` is the same
dynamic programme that reproduces the optimum.

    python bench/blackjack_policies.py [--held-out 2000] [--run DIR [--label final]]

Beside the exact price of each deterministic policy it prints what the policy scores on
the recipe's held-out deals (the first `--held-out` of them, each played out), which are
not an average sample: a run's final return is measured on them.

With `--run`, it also prices a run's learned policy: the hit share in each (total, up card,
soft) cell of one of its evaluations (a cell never visited taken as a coin flip), what that
policy would be worth with each cell cut as nucleus sampling at `top_p` cuts it (a call
holding at least `top_p` is always played), and how much playing the optimal chart in one
band of totals would add: where the run's remaining loss lies.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from plies.environments.blackjack import BlackjackGame, total, usable_ace
from plies.recipes.blackjack.config import EVAL_SEEDS
from plies.recipes.blackjack.strategy import expected_return, optimal_hits, played_policy

Policy = Callable[[int, int, bool], float]


def noisy(policy: Callable[[int, int, bool], bool], error: float) -> Policy:
    """`policy`'s call with probability 1 - error, the other call otherwise."""
    return lambda t, u, s: 1.0 - error if policy(t, u, s) else error


def hit_below(threshold: int) -> Callable[[int, int, bool], bool]:
    return lambda t, u, s: t < threshold


def bands(low: float, middle: float, high: float) -> Policy:
    """Hit shares at totals <= 11, 12-16 and >= 17, whatever the dealer shows."""
    return lambda t, u, s: low if t <= 11 else middle if t <= 16 else high


POLICIES: dict[str, Policy] = {
    "optimal": noisy(optimal_hits, 0.0),
    "hit below 17": noisy(hit_below(17), 0.0),
    "hit below 16": noisy(hit_below(16), 0.0),
    "hit below 15": noisy(hit_below(15), 0.0),
    "hit below 12": noisy(hit_below(12), 0.0),
    "always stand": lambda t, u, s: 0.0,
    "random (hit or stand by a coin)": lambda t, u, s: 0.5,
    "optimal, 2% of calls the other way": noisy(optimal_hits, 0.02),
    "optimal, 5% of calls the other way": noisy(optimal_hits, 0.05),
    "optimal, 10% of calls the other way": noisy(optimal_hits, 0.10),
    "hit below 17, 5% of calls the other way": noisy(hit_below(17), 0.05),
    # What cloning the threshold players (threshold uniform on 12..21) converges to.
    "threshold players' average": lambda t, u, s: 1.0 if t <= 11 else max(0.0, (21 - t) / 10),
    "bands 1.00 / 0.50 / 0.00": bands(1.0, 0.5, 0.0),
    "bands 0.95 / 0.50 / 0.05": bands(0.95, 0.5, 0.05),
}


PLAYED = ("optimal", "hit below 17", "hit below 16", "hit below 15", "hit below 12", "always stand")
"""The deterministic policies, played out on the held-out deals."""

BANDS: dict[str, Callable[[int, bool], bool]] = {
    "hard <= 11": lambda t, soft: t <= 11 and not soft,
    "hard 12-16": lambda t, soft: 12 <= t <= 16 and not soft,
    "hard >= 17": lambda t, soft: t >= 17 and not soft,
    "soft": lambda t, soft: soft,
}


def learned(run: Path, label: str) -> Policy:
    """The hit share per cell of the run's last evaluation labelled `label`."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    evals = [r for r in records if r["kind"] == "eval" and r["label"] == label]
    if not evals:
        raise SystemExit(f"{run}: no {label!r} evaluation in metrics.jsonl")
    return played_policy(evals[-1]["decisions"])


def cut(policy: Policy, top_p: float) -> Policy:
    """`policy` with a call that holds at least `top_p` of a cell played every time."""

    def hit_share(t: int, u: int, s: bool) -> float:
        p = policy(t, u, s)
        return 1.0 if p >= top_p else 0.0 if 1.0 - p >= top_p else p

    return hit_share


def optimal_in(policy: Policy, band: Callable[[int, bool], bool]) -> Policy:
    return lambda t, u, s: float(optimal_hits(t, u, s)) if band(t, s) else policy(t, u, s)


def held_out(policy: Policy, hands: int) -> float:
    """The mean reward of deterministic `policy` on the first `hands` held-out deals."""
    reward = 0.0
    for i in range(hands):
        game = BlackjackGame.deal(EVAL_SEEDS + i)
        while not game.done:
            if policy(total(game.player), game.dealer[0], usable_ace(game.player)) > 0.5:
                game.hit()
            else:
                game.stand()
        reward += game.reward
    return reward / hands


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--held-out", type=int, default=2000, help="held-out deals played")
    parser.add_argument("--run", type=Path, help="a `plies demo blackjack` run directory")
    parser.add_argument("--label", default="final", help="which evaluation (final, warm_start)")
    args = parser.parse_args()
    width = max(map(len, POLICIES))
    print(f"{'policy':<{width}}  {'exact':>7}  {f'{args.held_out} held-out deals':>20}")
    for name, policy in POLICIES.items():
        played = f"{held_out(policy, args.held_out):+.4f}" if name in PLAYED else "-"
        print(f"{name:<{width}}  {expected_return(policy):+.4f}  {played:>20}")
    if args.run is None:
        return
    policy = learned(args.run, args.label)
    base = expected_return(policy)
    print(f"\n{args.run} ({args.label} evaluation), each cell at its hit share: {base:+.4f}")
    for top_p in (0.99, 0.95, 0.9, 0.8):
        print(f"  cut at top_p {top_p}: {expected_return(cut(policy, top_p)):+.4f}")
    for name, band in BANDS.items():
        gain = expected_return(optimal_in(policy, band)) - base
        print(f"  optimal at {name}: {gain:+.4f}")


if __name__ == "__main__":
    main()
