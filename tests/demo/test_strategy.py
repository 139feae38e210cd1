"""The strategy grid and the paired confidence intervals that `summary.json` reports."""

from __future__ import annotations

import json
import random

import pytest

from plies.environments.blackjack import BlackjackGame, total
from plies.environments.blackjack_exact import (
    ALWAYS_STAND_RETURN,
    HARD_TOTALS,
    OPTIMAL_RETURN,
    RANDOM_RETURN,
    SOFT_TOTALS,
    UP_CARDS,
    expected_return,
    optimal_hits,
    optimal_return,
    played_policy,
    strategy_table,
)
from plies.recipes.blackjack.config import EVAL_SEEDS, DemoConfig
from plies.recipes.blackjack.report import (
    plot_strategy,
    result_lines,
    write_summary,
)
from plies.rl import RunLog, mean_stderr, paired_improvement

PNG = b"\x89PNG\r\n\x1a\n"


def test_expected_return_prices_any_mix_of_hitting_and_standing():
    assert expected_return(lambda t, u, s: float(t < 17)) == pytest.approx(-0.079, abs=5e-4)
    assert expected_return(lambda t, u, s: 0.0) == pytest.approx(ALWAYS_STAND_RETURN, abs=5e-4)
    assert expected_return(lambda t, u, s: 0.5) == pytest.approx(RANDOM_RETURN, abs=5e-4)
    with pytest.raises(ValueError, match="not a probability"):
        expected_return(lambda t, u, s: 1.5)


def test_expected_return_agrees_with_the_real_game():
    """A stochastic policy (hit below 17 with probability 0.9, above with 0.1) played on
    the game itself: the programme's value lies within four standard errors of the mean."""

    def share(player: int, up: int, soft: bool) -> float:
        return 0.9 if player < 17 else 0.1

    rng, rewards = random.Random(7), []
    for seed in range(40_000):
        game = BlackjackGame.deal(seed)
        while not game.done:
            if rng.random() < share(total(game.player), game.dealer[0], False):
                game.hit()
            else:
                game.stand()
        rewards.append(game.reward)
    mean, stderr = mean_stderr(rewards)
    assert abs(mean - expected_return(share)) < 4 * stderr


def test_a_played_policy_is_the_hit_share_of_each_cell_it_met():
    """Decisions as an evaluation records them: each cell's share of hits, or of hit chances;
    a cell never met is a coin flip. The optimal chart's own decisions price at the optimum."""
    policy = played_policy([(16, 10, False, True), (16, 10, False, False), (16, 10, False, 1)])
    assert policy(16, 10, False) == pytest.approx(2 / 3)
    assert policy(16, 10, True) == policy(12, 4, False) == 0.5
    assert played_policy([(13, 2, False, 0.25), (13, 2, False, 0.75)])(13, 2, False) == 0.5
    chart = [
        (player, up, soft, optimal_hits(player, up, soft))
        for soft, totals in ((False, range(4, 22)), (True, SOFT_TOTALS))
        for player in totals
        for up in UP_CARDS
    ]
    assert expected_return(played_policy(chart)) == pytest.approx(optimal_return(), abs=1e-12)


def test_the_dynamic_programme_reproduces_the_documented_optimal_return():
    assert optimal_return() == pytest.approx(OPTIMAL_RETURN, abs=5e-4)
    assert optimal_return() > ALWAYS_STAND_RETURN


def test_the_optimal_grid_is_the_classic_chart_for_these_rules():
    for up in UP_CARDS:
        assert all(optimal_hits(t, up, False) for t in range(4, 12)), up
        assert not any(optimal_hits(t, up, False) for t in range(17, 22)), up
        assert all(optimal_hits(t, up, True) for t in range(12, 18)), up
        assert not optimal_hits(19, up, True), up
    # hard 13-16: stand against a weak dealer (2-6), hit against 7-10 and the ace (no peek)
    for player in range(13, 17):
        assert [optimal_hits(player, up, False) for up in UP_CARDS] == [
            True, False, False, False, False, False, True, True, True, True,
        ]  # fmt: skip
    assert [optimal_hits(12, up, False) for up in (2, 3, 4, 5, 6)] == [
        True,
        True,
        False,
        False,
        False,
    ]


def test_the_table_counts_each_decision_in_its_cell():
    decisions = [(16, 10, False, True)] * 3 + [(16, 10, False, False), (18, 1, True, False)]
    table = strategy_table(decisions)
    assert set(table) == {"hard", "soft"}
    assert set(table["hard"]) == {str(t) for t in HARD_TOTALS}
    assert set(table["soft"]) == {str(t) for t in SOFT_TOTALS}
    assert table["hard"]["16"]["10"] == {"hit_rate": 0.75, "decisions": 4, "optimal": "hit"}
    assert table["soft"]["18"]["A"] == {"hit_rate": 0.0, "decisions": 1, "optimal": "hit"}
    assert table["hard"]["20"]["5"] == {"hit_rate": None, "decisions": 0, "optimal": "stand"}


def test_the_strategy_figure_is_a_png(tmp_path):
    table = {"policy": "final", **strategy_table([(12, 4, False, True), (15, 7, True, False)])}
    path = tmp_path / "strategy.png"
    plot_strategy(table, path)
    assert path.read_bytes()[:8] == PNG


def _eval(label: str, step: int, rewards: list[float | None], decisions: list[list]) -> dict:
    scored = [r for r in rewards if r is not None]
    mean, stderr = mean_stderr(scored)
    return {
        "label": label, "step": step, "policy": 1, "seconds": 0.0, "return": mean,
        "episodes": len(scored), "ill_formed": 0, "failed": 0, "stand_rate": 0.5,
        "stderr": stderr, "rewards": rewards, "decisions": decisions,
    }  # fmt: skip


def test_the_summary_holds_paired_intervals_and_the_grid_and_draws_both_figures(tmp_path):
    log = RunLog(tmp_path / "metrics.jsonl")
    before = [-1.0, -1.0, 1.0, 0.0, -1.0, 1.0, -1.0, -1.0]
    after = [-1.0, 1.0, 1.0, 0.0, 1.0, 1.0, -1.0, -1.0]
    log.write("eval", **_eval("warm_start", 0, before, [[16, 10, False, False]] * 8))
    log.write("eval", **_eval("final", 3, after, [[16, 10, False, True], [20, 5, False, False]]))
    log.write("session", seconds=50.0)
    log.write("session", seconds=70.0)  # a resumed run: its minutes are every session's
    log.close()
    summary = write_summary(
        DemoConfig(out=tmp_path, budget="smoke"), RunLog(tmp_path / "metrics.jsonl")
    )
    assert summary["minutes"] == 2.0
    assert summary["final_return"] == pytest.approx(0.125)
    low, high = summary["final_ci95"]
    assert low < 0.125 < high and high - low == pytest.approx(
        2 * 1.96 * mean_stderr(after)[1], abs=1e-3
    )
    assert summary["improvement"] == pytest.approx(0.5) and summary["paired_hands"] == 8
    low, high = summary["improvement_ci95"]
    assert low < 0.5 < high and high - low == pytest.approx(
        2 * 1.96 * paired_improvement(before, after)[1], abs=1e-3
    )
    assert summary["strategy"]["policy"] == "final"
    assert summary["strategy"]["hard"]["16"]["10"] == {
        "hit_rate": 1.0, "decisions": 1, "optimal": "hit",
    }  # fmt: skip
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    for name in ("learning_curve.png", "strategy.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG, name
    lines = result_lines(summary, tmp_path)
    assert "paired on 8 hands" in lines[3] and "strategy.png" in lines[-1]


def test_the_headline_is_each_policy_priced_exactly_beside_the_deals_own_luck(tmp_path):
    """The final evaluation hit at 16 against a 10 and forfeit one hand at 12 against a 4;
    the warm start stood at 16 against a 10; every other cell is a coin flip in both."""
    log = RunLog(tmp_path / "metrics.jsonl")
    warm = _eval("warm_start", 0, [-1.0, 1.0, 0.0], [[16, 10, False, False]] * 3)
    final = _eval("final", 3, [1.0, -1.0, None], [[16, 10, False, True]] * 2)
    final["forfeits"] = [[12, 4, False]]
    log.write("eval", **warm)
    log.write("eval", **final)
    log.close()
    summary = write_summary(
        DemoConfig(out=tmp_path, budget="smoke"), RunLog(tmp_path / "metrics.jsonl")
    )
    coin = {(16, 10, False): 0.0}
    before = expected_return(lambda t, u, s: coin.get((t, u, s), 0.5))
    after = expected_return(
        lambda t, u, s: {(16, 10, False): 1.0, (12, 4, False): 0.0}.get((t, u, s), 0.5),
        lambda t, u, s: float((t, u, s) == (12, 4, False)),
    )
    assert summary["warm_start_exact"] == pytest.approx(before, abs=1e-4)
    assert summary["final_exact"] == pytest.approx(after, abs=1e-4)
    assert summary["improvement_exact"] == pytest.approx(after - before, abs=2e-4)
    for key in ("warm_start_exact", "final_exact", "improvement_exact"):
        low, high = summary[f"{key}_ci95"]
        assert low < summary[key] < high, key
    # The references, computed; and what the deals the final evaluation scored paid them.
    assert summary["references"] == pytest.approx(
        {"random": RANDOM_RETURN, "always_stand": ALWAYS_STAND_RETURN, "optimal": OPTIMAL_RETURN},
        abs=5e-4,
    )
    stand = []
    for i in (0, 1):  # hand 2 failed: not a deal the evaluation scored
        game = BlackjackGame.deal(EVAL_SEEDS + i)
        game.stand()
        stand.append(game.reward)
    assert summary["references_on_held_out"]["always_stand"] == pytest.approx(sum(stand) / 2)
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    exact, gain, sampled, paired = result_lines(summary, tmp_path)[:4]
    assert exact.startswith(f"priced exactly, per hand: final {after:+.3f} (95% CI ")
    assert f"warm start {before:+.3f} (95% CI " in exact and "optimal -0.047" in exact
    assert gain.startswith(f"improvement on the warm start, priced exactly: {after - before:+.3f}")
    assert sampled.startswith("sampled on 2 held-out hands: final +0.000 (95% CI")
    assert f"always stand {sum(stand) / 2:+.3f}" in sampled.split("the same deals played by")[1]
    assert paired.startswith("sampled improvement ")
