"""The data model: segments follow prompt extension exactly, and misalignment raises."""

from __future__ import annotations

import copy
import pickle

import pytest

from plies import PolicyRef, Status, Trajectory, TrajectoryError, Turn, UsageError

P0 = PolicyRef(uri="file:///p/0", version=0, digest="a")
P1 = PolicyRef(uri="file:///p/1", version=1, digest="b")


def turn(prompt, completion, *, extends=False, policy=P0, lp=None):
    return Turn(
        prompt_ids=prompt,
        extends=extends,
        completion_ids=completion,
        logprobs=lp if lp is not None else [-0.5] * len(completion),
        finish_reason="stop",
        policy=policy,
    )


def test_extending_turns_share_one_segment_with_exact_masks():
    traj = Trajectory(
        task_id="t",
        turns=[
            turn([1, 2, 3], [4, 5], lp=[-0.1, -0.2]),
            turn([6], [7, 8], extends=True, policy=P1, lp=[-0.3, -0.4]),
        ],
    )
    (seg,) = traj.segments()
    assert seg.tokens == [1, 2, 3, 4, 5, 6, 7, 8]
    assert seg.mask == [0, 0, 0, 1, 1, 0, 1, 1]
    assert seg.logprobs == [0, 0, 0, -0.1, -0.2, 0, -0.3, -0.4]
    assert seg.policy_version == [0, 0, 0, 0, 0, 1, 1, 1]
    assert seg.turns == (0, 2)
    assert traj.prompt_ids(1) == [1, 2, 3, 4, 5, 6]


def test_a_fresh_render_starts_a_new_segment():
    traj = Trajectory(
        task_id="t",
        turns=[turn([1, 2], [3]), turn([1, 9, 9], [4]), turn([5], [6], extends=True)],
    )
    segs = traj.segments()
    assert [s.tokens for s in segs] == [[1, 2, 3], [1, 9, 9, 4, 5, 6]]
    assert [s.turns for s in segs] == [(0, 1), (1, 3)]
    assert traj.prompt_ids(2) == [1, 9, 9, 4, 5]


def test_misaligned_logprobs_raise_naming_the_problem():
    with pytest.raises(TrajectoryError, match="2 completion ids but 1 logprobs"):
        turn([1], [2, 3], lp=[-0.1])


def test_first_turn_cannot_extend():
    traj = Trajectory(task_id="t", turns=[turn([1], [2], extends=True)])
    with pytest.raises(TrajectoryError) as info:
        traj.segments()
    assert info.value.turn == 0


def test_non_finite_logprob_on_a_sampled_token_names_its_position():
    traj = Trajectory(task_id="t", turns=[turn([1, 2], [3, 4], lp=[-0.1, float("nan")])])
    with pytest.raises(TrajectoryError) as info:
        traj.segments()
    assert info.value.position == 3


def test_json_round_trip_and_pickled_errors():
    traj = Trajectory(task_id="t", turns=[turn([1], [2])], reward=1.0)
    line = traj.model_dump_json()
    assert "\n" not in line
    assert Trajectory.model_validate_json(line) == traj
    err = pickle.loads(pickle.dumps(TrajectoryError("x", turn=3, position=4)))
    assert (err.turn, err.position, str(err)) == (3, 4, "x")


def test_a_settled_trajectory_is_final_and_changed_only_by_copy():
    traj = Trajectory(task_id="t")
    traj.turns.append(turn([1], [2]))  # an open record is written in place
    traj.settle(Status.COMPLETED, reward=1.0, info={"k": 1})
    refused = [
        lambda: setattr(traj, "reward", 0.0),
        lambda: setattr(traj, "status", Status.FAILED),
        lambda: traj.turns.append(turn([3], [4])),
        lambda: traj.messages.extend([{"role": "user", "content": "x"}]),
        lambda: traj.info.update(k=2),
        lambda: traj.metrics.__setitem__("m", 1.0),
        lambda: traj.settle(Status.FAILED),
    ]
    for change in refused:
        with pytest.raises(UsageError, match="settled"):
            change()
    assert (traj.reward, traj.status, len(traj.turns), traj.info) == (1.0, "completed", 1, {"k": 1})
    forfeited = traj.model_copy(update={"reward": -1.0})
    assert (forfeited.reward, traj.reward) == (-1.0, 1.0)
    with pytest.raises(UsageError):
        forfeited.turns.append(turn([3], [4]))


def test_a_loaded_or_copied_settled_trajectory_stays_final():
    traj = Trajectory(task_id="t", turns=[turn([1], [2])], status=Status.TRUNCATED)
    line = traj.model_dump_json()
    for again in (
        Trajectory.model_validate_json(line),
        pickle.loads(pickle.dumps(traj)),
        copy.deepcopy(traj),
        traj.model_copy(deep=True),
    ):
        assert again == traj and again.model_dump_json() == line
        with pytest.raises(UsageError):
            again.turns.append(turn([3], [4]))
