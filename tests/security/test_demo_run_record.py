"""The demo's `run.json`: written atomically, read strictly, and compared by value."""

from __future__ import annotations

import json
import subprocess
from dataclasses import asdict, replace

import pytest

from plies import ConfigError
from plies.recipes.blackjack import BUDGETS
from plies.recipes.blackjack.config import DemoConfig, recorded_budget
from plies.testing import plies_command


def demo(out) -> subprocess.CompletedProcess[str]:
    argv = plies_command("demo", "blackjack", "--out", str(out), "--budget", "smoke")
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def refused(done: subprocess.CompletedProcess[str], says: str) -> None:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and says in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("content", ["", "{", "[]", '{"config": {}}'])
def test_a_damaged_run_json_is_one_line(tmp_path, content):
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text(content)
    refused(demo(out), f"plies demo: {out / 'run.json'} is not a run record")
    assert (out / "run.json").read_text() == content  # left for the user to look at
    assert not (out / "metrics.jsonl").exists()


def test_a_budget_of_the_same_name_with_other_values_is_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    changed = asdict(replace(BUDGETS["smoke"], warm_steps=BUDGETS["smoke"].warm_steps + 1))
    key = DemoConfig(out=out, budget="smoke").key()  # the same options, whatever they are
    (out / "run.json").write_text(json.dumps({"config": key, "budget": changed}))
    steps = BUDGETS["smoke"].warm_steps
    refused(
        demo(out),
        "was run with other values of budget 'smoke' "
        f"(warm_steps differ: warm_steps={steps + 1} then, {steps} now)",
    )
    assert not (out / "metrics.jsonl").exists()


def test_a_run_recorded_before_a_field_existed_reads_it_at_its_default():
    """A field added since (nucleus sampling's share) was not there when an older run.json
    was written: that run ran with the default, so it matches."""
    smoke = asdict(BUDGETS["smoke"])
    older = {k: v for k, v in smoke.items() if k not in ("top_p", "loss")}
    assert recorded_budget(older) == smoke
    # A field without a default stays missing, so a damaged record still differs.
    assert "lr" not in recorded_budget({k: v for k, v in smoke.items() if k != "lr"})
    # What the run did record wins over a default.
    assert recorded_budget({**smoke, "top_p": 0.5})["top_p"] == 0.5


OLD = {
    "warm_tail_steps": 0, "warm_tail_lr": 3e-2, "advantages": "state_contrast",
    "contrast_share": 1.0,
}  # fmt: skip
"""Budget fields since removed, as an older run.json recorded them: at the values every run
of this version plays."""


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("warm_tail_steps", 2), ("warm_tail_lr", 1e-2), ("advantages", "group"),
        ("contrast_share", 0.5),
    ],
)  # fmt: skip
def test_a_field_removed_since_is_dropped_at_the_value_played_now_and_refused_otherwise(
    tmp_path, name, value
):
    """A run recorded with a removed field at the value this version plays ran as this
    version runs, so it resumes; one recorded with another value did what this version
    cannot, and is refused in one line that names the field."""
    smoke = asdict(BUDGETS["smoke"])
    assert recorded_budget({**smoke, **OLD}) == smoke
    with pytest.raises(ConfigError, match=f"budget field {name}={value}, which this"):
        recorded_budget({**smoke, **OLD, name: value})
    out = tmp_path / "run"
    out.mkdir()
    key = DemoConfig(out=out, budget="smoke").key()
    record = {"config": key, "budget": {**smoke, **OLD, name: value}}
    (out / "run.json").write_text(json.dumps(record))
    refused(demo(out), f"budget field {name}={value}, which this version of plies no longer")
    assert not (out / "metrics.jsonl").exists()


def test_a_refusal_names_only_what_differs_not_what_an_older_record_predates(tmp_path):
    """Nor a removed field it holds at the value played now."""
    out = tmp_path / "run"
    out.mkdir()
    changed = asdict(replace(BUDGETS["smoke"], warm_steps=BUDGETS["smoke"].warm_steps + 1))
    del changed["top_p"]
    changed.update(OLD)
    key = DemoConfig(out=out, budget="smoke").key()
    (out / "run.json").write_text(json.dumps({"config": key, "budget": changed}))
    steps = BUDGETS["smoke"].warm_steps
    refused(demo(out), f"(warm_steps differ: warm_steps={steps + 1} then, {steps} now)")
