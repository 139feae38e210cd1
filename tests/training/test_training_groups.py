"""training_groups refuses each kind of bad group with its reason; advantages and batches."""

from __future__ import annotations

import math

import pytest

from plies import ConfigError, Group, PolicyRef, Status, Trajectory, Turn
from plies.training import (
    RefusalReason,
    Truncated,
    grpo_advantages,
    training_batch,
    training_groups,
)

P3 = PolicyRef(uri="file:///run/policies/3", version=3, digest="sha256:3")
P4 = PolicyRef(uri="file:///run/policies/4", version=4, digest="sha256:4")
P6 = PolicyRef(uri="file:///run/policies/6", version=6, digest="sha256:6")


def turn(prompt, completion, *, extends=False, policy=P4):
    return Turn(
        prompt_ids=prompt,
        extends=extends,
        completion_ids=completion,
        logprobs=[-0.5] * len(completion),
        finish_reason="stop",
        policy=policy,
    )


def member(group_id: str, reward: float | None, *, status=Status.COMPLETED, policy=P4, **kw):
    return Trajectory(
        task_id="deal-7",
        group_id=group_id,
        turns=[turn([1, 2, 3], [4, 5], policy=policy), turn([6], [7], extends=True, policy=policy)],
        reward=reward,
        status=status,
        **kw,
    )


def group(gid: str, rewards=(1.0, -1.0, 0.0), *, size=None, policy=P4, members=None) -> Group:
    trajs = members if members is not None else [member(gid, r) for r in rewards]
    return Group(
        id=gid, task_id="deal-7", size=size or len(trajs), policy=policy, trajectories=trajs
    )


def check(*groups, truncated=Truncated.TRAIN, max_staleness=2, policy=P4):
    return training_groups(groups, policy=policy, max_staleness=max_staleness, truncated=truncated)


def reason(selection) -> tuple[RefusalReason, str]:
    assert selection.trainable == []
    (refusal,) = selection.refused
    return refusal.reason, refusal.detail


def test_a_good_group_is_trainable():
    good = group("g")
    selection = check(good)
    assert selection.trainable == [good] and selection.refused == []


def test_incomplete_groups_are_refused():
    missing = group("g", size=4)
    assert reason(check(missing)) == (RefusalReason.INCOMPLETE, "3 of 4 admitted members present")
    running = group("g", members=[member("g", 1.0), member("g", None, status=None)])
    why, detail = reason(check(running))
    assert why is RefusalReason.INCOMPLETE and "not settled" in detail


def test_duplicated_members_and_groups_are_refused():
    a = member("g", 1.0)
    why, detail = reason(check(group("g", members=[a, a])))
    assert why is RefusalReason.DUPLICATE and a.id in detail
    g = group("g")
    selection = check(g, g)
    assert selection.trainable == [g]
    assert [r.reason for r in selection.refused] == [RefusalReason.DUPLICATE]


def test_a_member_of_another_group_is_refused():
    stray = member("other", 1.0)
    why, detail = reason(check(group("g", members=[member("g", 0.0), stray])))
    assert why is RefusalReason.FOREIGN_MEMBER and stray.id in detail


def test_failed_members_are_refused():
    failed = member("g", None, status=Status.FAILED, error="sandbox died")
    why, detail = reason(check(group("g", members=[member("g", 1.0), failed])))
    assert why is RefusalReason.FAILED_MEMBER and "failed: sandbox died" in detail


def test_mixed_policies_are_refused():
    late = Trajectory(
        task_id="deal-7",
        group_id="g",
        turns=[turn([1, 2], [3]), turn([4], [5], extends=True, policy=P6)],
        reward=1.0,
        status=Status.COMPLETED,
    )
    why, detail = reason(check(group("g", members=[member("g", 0.0), late])))
    assert why is RefusalReason.MIXED_POLICY and "turn 1" in detail and "version 6" in detail


def test_stale_groups_are_refused():
    old = group("g", policy=P3, members=[member("g", r, policy=P3) for r in (1.0, 0.0)])
    assert check(old, policy=P4, max_staleness=1).trainable == [old]
    why, detail = reason(check(old, policy=P6, max_staleness=2))
    assert why is RefusalReason.STALE and "staleness 3 outside [0, 2]" in detail
    why, _ = reason(check(group("g"), policy=P3))  # sampled by a newer policy than current
    assert why is RefusalReason.STALE


def test_misaligned_segments_are_refused():
    # model_construct skips validation, as data read from a corrupted source could.
    bad_turn = Turn.model_construct(
        prompt_ids=[1, 2],
        extends=False,
        completion_ids=[3, 4],
        logprobs=[-0.1],
        finish_reason="stop",
        policy=P4,
    )
    bad = Trajectory(task_id="deal-7", group_id="g", reward=1.0, status=Status.COMPLETED)
    bad = bad.model_copy(update={"turns": [bad_turn]})  # a copy is not validated either
    why, detail = reason(check(group("g", members=[member("g", 0.0), bad])))
    assert why is RefusalReason.MISALIGNED and "logprobs has 3 entries for 4 tokens" in detail
    orphan = member("g", 1.0).model_copy(update={"turns": [turn([1], [2], extends=True)]})
    why, detail = reason(check(group("g", members=[orphan])))
    assert why is RefusalReason.MISALIGNED and "cannot extend" in detail
    out_of_vocab = training_groups([group("g")], policy=P4, max_staleness=0, vocab_size=5).refused[
        0
    ]
    assert out_of_vocab.reason is RefusalReason.MISALIGNED
    assert "token id 5 outside the vocabulary" in out_of_vocab.detail


@pytest.mark.parametrize("lp", [-200.0, -1e39, math.nan, -math.inf])
def test_sampler_logprobs_no_sampler_could_produce_are_refused(lp):
    poisoned = member("g", 1.0)
    poisoned.turns[0].logprobs[1] = lp  # as a corrupted source or a buggy engine could
    why, detail = reason(check(group("g", members=[member("g", 0.0), poisoned])))
    assert why is RefusalReason.MISALIGNED and "logprob" in detail


@pytest.mark.parametrize("bad", [math.nan, math.inf, None])
def test_non_finite_rewards_are_refused(bad):
    why, detail = reason(check(group("g", rewards=(1.0, bad))))
    assert why is RefusalReason.NON_FINITE_REWARD and f"reward {bad}" in detail


def test_truncated_members_follow_the_chosen_handling():
    members = [member("g", 1.0), member("g", -1.0, status=Status.TRUNCATED)]
    g = group("g", members=members)
    assert check(g, truncated="train").trainable == [g]
    why, _ = reason(check(g, truncated=Truncated.REFUSE))
    assert why is RefusalReason.TRUNCATED
    (kept,) = check(g, truncated=Truncated.DROP).trainable
    assert [t.id for t in kept.trajectories] == [members[0].id] and kept.size == 1
    assert len(g.trajectories) == 2  # the input is never modified
    with pytest.raises(ConfigError, match="unknown truncated handling 'keep'"):
        check(g, truncated="keep")


def test_each_refusal_is_reported_in_order_and_the_rest_train():
    good = group("ok")
    selection = check(group("short", size=5), good, group("nan", rewards=(math.nan, 1.0)))
    assert selection.trainable == [good]
    assert [(r.group_id, r.reason) for r in selection.refused] == [
        ("short", RefusalReason.INCOMPLETE),
        ("nan", RefusalReason.NON_FINITE_REWARD),
    ]


def test_grpo_advantages():
    assert grpo_advantages([1.0, -1.0, 0.0, 0.0]) == [1.0, -1.0, 0.0, 0.0]
    scaled = grpo_advantages([1.0, -1.0, 1.0, -1.0], scale_std=True)
    assert scaled == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)
    assert grpo_advantages([0.5, 0.5], scale_std=True) == [0.0, 0.0]
    with pytest.raises(ConfigError, match="finite"):
        grpo_advantages([1.0, math.nan])
    with pytest.raises(ConfigError, match="empty"):
        grpo_advantages([])


def test_training_batch_puts_each_members_advantage_on_its_sampled_tokens():
    g = group("g", rewards=(1.0, -1.0, 0.0))
    adv = grpo_advantages([t.reward for t in g.trajectories])
    batch = training_batch([g], [adv], temperature=0.8)
    assert batch.temperature == 0.8 and len(batch.data) == 3
    d = batch.data[0]
    assert d.tokens == [1, 2, 3, 4, 5, 6, 7]
    assert d.mask == [0, 0, 0, 1, 1, 0, 1]
    assert d.advantages == [0, 0, 0, 1.0, 1.0, 0, 1.0]
    assert d.logprobs == [0, 0, 0, -0.5, -0.5, 0, -0.5]
    skipped = training_batch([g], [adv], temperature=0.8, skip_zero=True)
    assert [x.advantages[3] for x in skipped.data] == [1.0, -1.0]
    with pytest.raises(ConfigError, match="2 advantages for 3 members"):
        training_batch([g], [[1.0, 2.0]], temperature=1.0)
