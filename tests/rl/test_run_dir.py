"""`plies.rl`'s run directory and settings: a run is resumed only with what it was made with,
and bad settings are refused by name before any work."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from plies import ConfigError, PolicyRef
from plies.environments import BlackjackEnv, Task
from plies.policy import VLLMClient
from plies.rl import RUN_SCHEMA, GRPOConfig, remove_run_dir, train
from plies.rl._train import claim_run_dir
from plies.runtime import Interrupts
from plies.testing import closed_url
from plies.training import TrainingClient


def test_a_new_directory_is_claimed_and_the_same_settings_resume_it(tmp_path):
    settings = asdict(GRPOConfig(steps=3))
    assert claim_run_dir(tmp_path / "run", "grpo", settings) is False
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record == {"schema": RUN_SCHEMA, "kind": "grpo", "config": settings}
    assert claim_run_dir(tmp_path / "run", "grpo", settings) is True


def test_other_settings_are_refused_naming_each_with_both_values(tmp_path):
    claim_run_dir(tmp_path, "grpo", asdict(GRPOConfig(steps=3, lr=1e-4)))
    with pytest.raises(ConfigError) as err:
        claim_run_dir(tmp_path, "grpo", asdict(GRPOConfig(steps=5, lr=1e-4)))
    assert "steps=3 then, 5 now" in str(err.value) and "lr" not in str(err.value)


def test_another_kind_or_schema_is_refused(tmp_path):
    claim_run_dir(tmp_path, "grpo", {})
    with pytest.raises(ConfigError, match="holds a 'grpo' run of schema 1, not a 'sft' run"):
        claim_run_dir(tmp_path, "sft", {})
    (tmp_path / "run.json").write_text(json.dumps({"schema": 99, "kind": "grpo", "config": {}}))
    with pytest.raises(ConfigError, match="of schema 99"):
        claim_run_dir(tmp_path, "grpo", {})


@pytest.mark.parametrize("text", ["{not json", "[]", '{"schema": 1}'])
def test_a_run_json_that_does_not_read_back_is_refused(tmp_path, text):
    (tmp_path / "run.json").write_text(text)
    with pytest.raises(ConfigError, match="is not a run record"):
        claim_run_dir(tmp_path, "grpo", {})


def test_a_file_is_not_a_run_directory(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="is a file"):
        claim_run_dir(tmp_path / "f", "grpo", {})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("steps", 0),
        ("group_size", 1),
        ("groups_per_step", 0),
        ("max_staleness", -1),
        ("max_idle_batches", 0),
        ("lr", 0.0),
        ("lr", float("nan")),
        ("lr", float("inf")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("loss", "cross_entropy"),
        ("steps", 2.5),
    ],
)
def test_settings_out_of_range_are_refused_by_name(field, value):
    with pytest.raises(ConfigError, match=rf"GRPOConfig\.{field} is"):
        GRPOConfig(**{"steps": 3, field: value})


def test_the_bounds_follow_from_the_settings():
    config = GRPOConfig(steps=3, group_size=8, groups_per_step=4, max_staleness=2)
    assert config.groups_in_flight == 8
    assert config.max_idle_episodes == 5 * 4 * 8
    assert GRPOConfig(steps=1, max_staleness=0).groups_in_flight == 8  # one batch in flight


@pytest.mark.anyio
@pytest.mark.parametrize(("every", "held_out"), [(2, ()), (-1, (Task(id="h"),)), (1.5, ())])
async def test_eval_every_needs_held_out_tasks_and_is_refused_before_any_work(
    tmp_path, every, held_out
):
    """Clients that were never opened: the refusal comes before anything uses them."""
    with pytest.raises(ConfigError, match=f"eval_every is {every!r}"):
        await train(
            tmp_path / "run", GRPOConfig(steps=1), tasks=lambda i: Task(id=str(i)),
            env=BlackjackEnv, play=lambda ctx: ctx, trainer=TrainingClient(closed_url()),
            sampler=VLLMClient(closed_url(), "m"), policy=PolicyRef(uri="base", version=0),
            interrupts=Interrupts(), held_out=held_out, eval_every=every,
        )  # fmt: skip
    assert not (tmp_path / "run").exists()


def test_remove_run_dir_removes_a_run_and_nothing_that_is_not_one(tmp_path):
    run = tmp_path / "run"
    claim_run_dir(run, "grpo", asdict(GRPOConfig(steps=3)))
    (run / "metrics.jsonl").write_text("")
    assert remove_run_dir(run) is True and not run.exists()
    assert remove_run_dir(run) is False  # nothing there: nothing to do
    (tmp_path / "empty").mkdir()
    assert remove_run_dir(tmp_path / "empty") is True and not (tmp_path / "empty").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("not a run")
    with pytest.raises(ConfigError, match=r"holds files but no run\.json"):
        remove_run_dir(mine)
    (tmp_path / "f").write_text("a file")
    with pytest.raises(ConfigError, match="is a file"):
        remove_run_dir(tmp_path / "f")
    assert (mine / "notes.txt").read_text() == "not a run"
    assert (tmp_path / "f").read_text() == "a file"


@pytest.mark.anyio
@pytest.mark.parametrize("keep", [0, -1, 1.5])
async def test_keep_policies_below_one_is_refused_before_any_work(tmp_path, keep):
    with pytest.raises(ConfigError, match=f"keep_policies is {keep!r}: at least 1"):
        await train(
            tmp_path / "run", GRPOConfig(steps=1), tasks=lambda i: Task(id=str(i)),
            env=BlackjackEnv, play=lambda ctx: ctx, trainer=TrainingClient(closed_url()),
            sampler=VLLMClient(closed_url(), "m"), policy=PolicyRef(uri="base", version=0),
            interrupts=Interrupts(), keep_policies=keep,
        )  # fmt: skip
    assert not (tmp_path / "run").exists()
