"""What the terminal says about a GRPO batch: refusals explained, groups set aside while it
filled, a batch that trained nothing not counted as a step, and GRPO stopped once groups in
a row trained nothing."""

from __future__ import annotations

from plies import PolicyRef
from plies.recipes.blackjack import BUDGETS
from plies.recipes.blackjack.config import MAX_IDLE_BATCHES
from plies.rl import RunLog
from plies.rl._grpo import idle_streak, set_aside_counts
from plies.rl._lines import REFUSALS, step_line, stopped_line
from plies.training import RefusalReason

POLICY = PolicyRef(uri="file:///run/server/policies/7", version=7, digest="")


def _info(refused: list[str], trainable: int, tied: int, ret: float | None) -> dict:
    groups = [f"train-{i}" for i in range(8)]
    return {
        "groups": groups, "trainable": trainable, "refused": refused, "tied": tied,
        "train_return": ret,
    }  # fmt: skip


def test_every_refusal_reason_has_words():
    assert set(REFUSALS) == {r.value for r in RefusalReason}


def test_a_step_line_says_what_trained_what_was_refused_and_why_and_what_tied():
    info = _info(["train-3: stale", "train-5: non_finite_reward", "train-6: stale"], 5, 2, -0.25)
    line = step_line(4, info, POLICY, {})
    assert line.startswith("step 4 -> policy v7: trained on 3 of 8 groups (train return -0.250)")
    assert "3 refused by the checks before training" in line
    assert f"2 {REFUSALS['stale']}" in line and f"1 {REFUSALS['non_finite_reward']}" in line
    assert "2 tied (members all scored alike: nothing to learn)" in line


def test_a_batch_that_trained_nothing_says_it_is_not_a_step():
    info = _info([f"train-{i}: non_finite_reward" for i in range(6)], 2, 2, -1.0)
    line = step_line(9, info, None, {})
    assert "trained on 0 of 8 groups" in line and "6 refused" in line
    assert line.endswith("not a step, sampling another batch")


def test_a_step_line_says_what_was_set_aside_while_the_batch_filled():
    line = step_line(2, _info([], 8, 0, 0.125), POLICY, {"tied": 5, "stale": 1})
    assert line.startswith("step 2 -> policy v7: trained on 8 of 8 groups (train return +0.125)")
    assert line.endswith(f"6 set aside while the batch filled (5 tied, 1 {REFUSALS['stale']})")


def test_the_idle_streak_counts_episodes_since_the_last_trained_step(tmp_path):
    """A certain group (one member played) weighs one episode; a group set aside by a log
    older than the count, or in a batch that trained nothing, weighs a full group."""
    log = RunLog(tmp_path / "metrics.jsonl")
    assert idle_streak(log, 16) == 0
    log.write("skipped", step=0, groups=["train-0"])
    log.write("set_aside", step=0, groups=["train-1"], reason="tied", episodes=16)
    log.write("step", step=0, groups=["train-2"])
    log.write("set_aside", step=1, groups=["train-3"], reason="tied", episodes=16)
    log.write("set_aside", step=1, groups=["train-4"], reason="certain", episodes=1)
    assert set_aside_counts(log) == {"tied": 1, "certain": 1}
    log.write("step_begin", step=1, groups=["train-5", "train-6"])
    log.write("skipped", step=1, groups=["train-5", "train-6"])
    assert set_aside_counts(log) == {}  # the next batch starts empty
    log.write("set_aside", step=1, groups=["train-7"], reason="stale")  # an older log
    log.write("eval", label="curve", step=1)
    log.close()
    again = RunLog(tmp_path / "metrics.jsonl")  # a resumed run counts the same
    assert idle_streak(again, 16) == 16 + 1 + 2 * 16 + 16
    assert set_aside_counts(again) == {"stale": 1}
    budget = BUDGETS["default"]
    assert budget.max_idle_episodes == MAX_IDLE_BATCHES * 8 * 16
    assert "640 episodes in a row" in stopped_line(1, budget.max_idle_episodes)
    again.close()
