"""What a Blackjack policy is worth, exactly: the prices docs/training.md quotes.

The flagship target (-0.08 on held-out hands, sampled at temperature 1) is a statement about
a stochastic policy. This prints the exact expected return per hand of the reference
policies and of their noisy versions, side by side, so the target can be read against what
a policy's leftover randomness costs. No sampling: `strategy.expected_return` is the same
dynamic programme that reproduces the optimum.

    python bench/blackjack_policies.py
"""

from __future__ import annotations

from collections.abc import Callable

from plies.recipes.blackjack.strategy import expected_return, optimal_hits

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


def main() -> None:
    width = max(map(len, POLICIES))
    for name, policy in POLICIES.items():
        print(f"{name:<{width}}  {expected_return(policy):+.4f}")


if __name__ == "__main__":
    main()
