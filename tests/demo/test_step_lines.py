"""What the terminal says about a GRPO batch: refusals explained, a batch that trained
nothing not counted as a step, and GRPO stopped once batches in a row trained nothing."""

from __future__ import annotations

from plies import PolicyRef
from plies.recipes.blackjack import RunLog
from plies.recipes.blackjack.config import MAX_IDLE_BATCHES
from plies.recipes.blackjack.report import REFUSALS, idle_streak, step_line, stopped_line
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
    line = step_line(4, info, POLICY)
    assert line.startswith("step 4 -> policy v7: trained on 3 of 8 groups (train return -0.250)")
    assert "3 refused by the checks before training" in line
    assert f"2 {REFUSALS['stale']}" in line and f"1 {REFUSALS['non_finite_reward']}" in line
    assert "2 tied (members all scored alike: nothing to learn)" in line


def test_a_batch_that_trained_nothing_says_it_is_not_a_step():
    info = _info([f"train-{i}: non_finite_reward" for i in range(6)], 2, 2, -1.0)
    line = step_line(9, info, None)
    assert "trained on 0 of 8 groups" in line and "6 refused" in line
    assert line.endswith("not a step, sampling another batch")


def test_the_idle_streak_counts_batches_since_the_last_trained_step(tmp_path):
    log = RunLog(tmp_path / "metrics.jsonl")
    assert idle_streak(log) == 0
    log.write("skipped", step=0, groups=["train-0"])
    log.write("step", step=0, groups=["train-1"])
    for _ in range(MAX_IDLE_BATCHES):
        log.write("step_begin", step=1, groups=["train-2"])
        log.write("skipped", step=1, groups=["train-2"])
    log.write("eval", label="curve", step=1)
    log.close()
    again = RunLog(tmp_path / "metrics.jsonl")  # a resumed run counts the same
    assert idle_streak(again) == MAX_IDLE_BATCHES
    assert f"{MAX_IDLE_BATCHES} batches in a row" in stopped_line(1, 8)
    again.close()
