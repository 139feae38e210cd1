"""`plies view` on crafted run directories: every file checked on load, each problem one line.

A FIFO where `run.json` should be blocked a plain `read()` forever; `summary.json` linked to
`/dev/zero` never ended; records of the wrong types reached the page. Now each is a sentence
naming the file (and the line), and the rest of the run is still shown.
"""

from __future__ import annotations

import json
import os
import subprocess

from _view_runs import write_run
from smoke_run import ENV

from plies.testing import plies_command
from plies.view import RunView


def test_special_files_and_wrong_types_are_problems_not_hangs(tmp_path, qwen3_tokenizer):
    run = write_run(tmp_path / "run", qwen3_tokenizer, groups=4, size=2, turns=2)
    (run / "run.json").unlink()
    os.mkfifo(run / "run.json")
    (run / "summary.json").unlink()
    (run / "summary.json").symlink_to("/dev/zero")
    (run / "quarantine.json").mkdir()
    with (run / "metrics.jsonl").open("a") as f:
        for record in (
            {"kind": "step", "step": "<b>7</b>", "groups": ["train-0"]},
            {"kind": "step", "step": 8, "groups": "train-0"},
            {"kind": "eval", "step": 9, "return": "high"},
            {"kind": "step", "step": 10, "policy": {"version": "v1"}},
        ):
            f.write(json.dumps(record) + "\n")
    lines = len((run / "metrics.jsonl").read_text().splitlines())
    result = subprocess.run(
        plies_command("view", str(run), "--out", str(tmp_path / "page.html")),
        capture_output=True, text=True, env=ENV, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    snap = RunView(run)._reader.refresh()
    problems = "\n".join(snap.problems)
    for expected in (
        "run.json: ", "run.json is a FIFO, not a regular file",
        "summary.json is a character device, not a regular file",
        "quarantine.json: ", "quarantine.json is a directory",
        f"metrics.jsonl: line {lines - 3}: step is str", f"metrics.jsonl: line {lines - 2}: groups",
        f"metrics.jsonl: line {lines - 1}: return is str", f"metrics.jsonl: line {lines}: policy",
    ):  # fmt: skip
        assert expected in problems, (expected, problems)
    assert all("\n" not in p for p in snap.problems)
    assert len(snap.groups) == 4 and len(snap.steps()) == 2  # the rest of the run is read
    assert snap.run is None and snap.summary is None


def test_a_line_over_its_cap_is_a_problem(tmp_path, qwen3_tokenizer, monkeypatch):
    from plies.view import _files, _load

    run = write_run(tmp_path / "run", qwen3_tokenizer, groups=2, size=2, turns=2)
    monkeypatch.setattr(_load, "LINE_CAP", 1000)  # a group line is several KB
    problems = RunView(run)._reader.refresh().problems
    assert any("groups.jsonl: line 1 is longer than 1,000 bytes" in p for p in problems)
    monkeypatch.setattr(_load, "JSONL_CAP", 100)
    monkeypatch.setattr(_files, "LINE_CAP", 1000)
    problems = RunView(run)._reader.refresh().problems
    assert any("groups.jsonl holds" in p and "more than the 100 allowed" in p for p in problems)


def test_a_run_of_another_schema_is_shown_with_a_problem_saying_so(tmp_path, qwen3_tokenizer):
    from plies.rl import RUN_SCHEMA

    run = write_run(tmp_path / "run", qwen3_tokenizer, groups=2, size=2, turns=2)
    record = json.loads((run / "run.json").read_text())
    assert RunView(run)._reader.refresh().problems == []  # a recipe's run, no schema: fine
    (run / "run.json").write_text(json.dumps({**record, "schema": RUN_SCHEMA + 1}))
    snap = RunView(run)._reader.refresh()
    assert snap.problems == [
        f"run.json is of schema {RUN_SCHEMA + 1}, and this plies reads schema {RUN_SCHEMA} "
        "(docs/rl.md): records it does not know are left out"
    ]
    assert len(snap.groups) == 2  # the rest of the run is read
