"""What a Blackjack policy is worth, exactly: the prices docs/training.md quotes.

The flagship target (-0.08 on held-out hands, sampled at temperature 1) is a statement about
a stochastic policy. This prints the exact expected return per hand of the reference
policies and of their noisy versions, side by side, so the target can be read against what
a policy's leftover randomness costs. No sampling: `blackjack_exact.expected_return` is the same
dynamic programme that reproduces the optimum.

    python bench/blackjack_policies.py [--held-out 2000] [--coverage 60] [--run DIR [--label final]]

Beside the exact price of each policy it prints what the policy is expected to score on
the recipe's held-out deals (the first `--held-out` of them; `blackjack_exact.on_deals`), which are
not an average sample: a run's final return is measured on them.

Then it plays one stochastic policy (the optimal chart with 5% of its calls the other way) on
`--held-out` deals of the game, as a run's evaluation would, and judges that evaluation as a
run's summary does: sampled (its mean, beside the references on the same deals) and priced
(`blackjack_exact.price`, with its interval, against the policy's exact value), timing what the
judging adds to a run. With `--coverage N` it does that N times for a few policies, each on
fresh deals, and counts how often the priced interval held the exact value (95% is its aim).

With `--run`, it also prices a run's learned policy as the demo's summary does
(`blackjack_exact.price`: the shares of hit, stand and forfeit in each (total, up card, soft) cell
of one of its evaluations, a cell never visited taken as a coin flip, with a 95% interval), what
that policy would be worth with each cell cut as nucleus sampling at `top_p` cuts it (a call holding
at least `top_p` is always played), and how much playing the optimal chart in one band of totals
would add: where the run's remaining loss lies.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

from plies.environments.blackjack import BlackjackGame, total, usable_ace
from plies.environments.blackjack_exact import (
    REFERENCES,
    expected_return,
    on_deals,
    optimal_hits,
    played_policy,
    price_record,
)
from plies.recipes.blackjack.config import EVAL_SEEDS
from plies.recipes.blackjack.report import exact_figures
from plies.rl import ci95, mean_stderr

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
    # The same against a 7 to an ace; against a 2 to 6 they stand on 12 or more (the
    # bust-card players of docs/research.md); the majority call is "hit below 16" there.
    "bust-card players' average": lambda t, u, s: (
        1.0 if t <= 11 else 0.0 if 2 <= u <= 6 else max(0.0, (21 - t) / 10)
    ),
    "bust-card players' majority": lambda t, u, s: float(t < (12 if 2 <= u <= 6 else 16)),
    "bands 1.00 / 0.50 / 0.00": bands(1.0, 0.5, 0.0),
    "bands 0.95 / 0.50 / 0.05": bands(0.95, 0.5, 0.05),
}


BANDS: dict[str, Callable[[int, bool], bool]] = {
    "hard <= 11": lambda t, soft: t <= 11 and not soft,
    "hard 12-16": lambda t, soft: 12 <= t <= 16 and not soft,
    "hard >= 17": lambda t, soft: t >= 17 and not soft,
    "soft": lambda t, soft: soft,
}


def learned(run: Path, label: str) -> dict:
    """The run's last evaluation labelled `label`, as its metrics.jsonl holds it."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    evals = [r for r in records if r["kind"] == "eval" and r["label"] == label]
    if not evals:
        raise SystemExit(f"{run}: no {label!r} evaluation in metrics.jsonl")
    return evals[-1]


def cut(policy: Policy, top_p: float) -> Policy:
    """`policy` with a call that holds at least `top_p` of a cell played every time."""

    def hit_share(t: int, u: int, s: bool) -> float:
        p = policy(t, u, s)
        return 1.0 if p >= top_p else 0.0 if 1.0 - p >= top_p else p

    return hit_share


def optimal_in(policy: Policy, band: Callable[[int, bool], bool]) -> Policy:
    return lambda t, u, s: float(optimal_hits(t, u, s)) if band(t, s) else policy(t, u, s)


def evaluation(policy: Policy, hands: int, seed: int = 0) -> dict:
    """An evaluation record (rewards, decisions) of `policy` played on `hands` deals: the
    held-out ones for seed 0, others for another."""
    rng, rewards, decisions = random.Random(seed), [], []
    for i in range(hands):
        game = BlackjackGame.deal(EVAL_SEEDS * (1 + 2 * seed) + i)
        while not game.done:
            cell = (total(game.player), game.dealer[0], usable_ace(game.player))
            hit = rng.random() < policy(*cell)
            decisions.append([*cell, hit])
            game.hit() if hit else game.stand()
        rewards.append(game.reward)
    return {"rewards": rewards, "decisions": decisions, "forfeits": []}


def judged(name: str, hands: int) -> None:
    """Judge an evaluation of `name` on `hands` deals as a run's summary does, timed."""
    policy = POLICIES[name]
    record = evaluation(policy, hands)
    mean, stderr = mean_stderr(record["rewards"])
    t0 = time.perf_counter()
    figures = exact_figures(record, record)  # the two evaluations a run prices
    t1 = time.perf_counter()
    seeds = range(EVAL_SEEDS, EVAL_SEEDS + hands)
    refs = {ref: on_deals(p, seeds) for ref, p in REFERENCES.items()}
    t2 = time.perf_counter()
    low, high = figures["final_exact_ci95"]
    sampled_low, sampled_high = ci95(mean, stderr)
    played = ", ".join(f"{ref} {v:+.4f}" for ref, v in refs.items())
    print(
        f"\nan evaluation of {name!r} on {hands} held-out deals: sampled {mean:+.4f} "
        f"(95% CI {sampled_low:+.4f} to {sampled_high:+.4f}; the same deals "
        f"played by {played}); priced {figures['final_exact']:+.4f} (95% CI {low:+.4f} to "
        f"{high:+.4f}); exact {expected_return(policy):+.4f}"
    )
    print(
        f"what judging a run adds: pricing its two evaluations {t1 - t0:.3f} s, the "
        f"references on the deals {t2 - t1:.3f} s"
    )


COVERED = ("optimal, 5% of calls the other way", "bands 1.00 / 0.50 / 0.00", "hit below 17")


def coverage(runs: int, hands: int) -> None:
    """How often `runs` evaluations' priced intervals held each policy's exact value."""
    for name in COVERED:
        exact, held = expected_return(POLICIES[name]), 0
        for seed in range(1, runs + 1):
            priced = price_record(evaluation(POLICIES[name], hands, seed))
            low, high = ci95(priced.value, priced.stderr)
            held += low <= exact <= high
        print(f"  {name}: the interval held the exact value in {held} of {runs} evaluations")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--held-out", type=int, default=2000, help="held-out deals played")
    parser.add_argument("--coverage", type=int, default=0, help="evaluations per policy")
    parser.add_argument("--run", type=Path, help="a `plies demo blackjack` run directory")
    parser.add_argument("--label", default="final", help="which evaluation (final, warm_start)")
    args = parser.parse_args()
    width = max(map(len, POLICIES))
    print(f"{'policy':<{width}}  {'exact':>7}  {f'{args.held_out} held-out deals':>20}")
    for name, policy in POLICIES.items():
        played = on_deals(policy, range(EVAL_SEEDS, EVAL_SEEDS + args.held_out))
        print(f"{name:<{width}}  {expected_return(policy):+.4f}  {played:>+20.4f}")
    judged("optimal, 5% of calls the other way", args.held_out)
    if args.coverage:
        print(f"the priced intervals of {args.coverage} evaluations of {args.held_out} hands each:")
        coverage(args.coverage, args.held_out)
    if args.run is None:
        return
    record = learned(args.run, args.label)
    priced = price_record(record)
    low, high = ci95(priced.value, priced.stderr)
    print(
        f"\n{args.run} ({args.label} evaluation), each cell at its shares: {priced.value:+.4f} "
        f"(95% CI {low:+.4f} to {high:+.4f}, {priced.decisions} decisions); sampled "
        f"{record['return']:+.4f} on {record['hands']} hands"
    )
    policy = played_policy(record["decisions"])  # hit or stand: what the cuts below act on
    base = expected_return(policy)
    for top_p in (0.99, 0.95, 0.9, 0.8):
        print(f"  cut at top_p {top_p}: {expected_return(cut(policy, top_p)):+.4f}")
    for name, band in BANDS.items():
        gain = expected_return(optimal_in(policy, band)) - base
        print(f"  optimal at {name}: {gain:+.4f}")


if __name__ == "__main__":
    main()
