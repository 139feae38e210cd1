"""`plies replay` on crafted run directories: one line and exit 2, never a hang or a traceback.

Each case breaks one file before replay could start a server: a FIFO where `run.json` should
be (a plain `read()` blocks forever), `groups.jsonl` linked to `/dev/zero` (never ends) or a
directory, and records of the wrong types, which used to escape as pydantic or type errors.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from _view_runs import write_run
from smoke_run import ENV

from plies.testing import plies_command

HANG = 60
"""Seconds after which a replay that has not answered is taken to hang on its input."""


def plies_replay(run: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        plies_command("replay", str(run), *args),
        capture_output=True, text=True, env=ENV, timeout=HANG,
    )  # fmt: skip


def assert_one_line(result: subprocess.CompletedProcess, *expected: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert lines[0].startswith("plies replay: "), lines
    for text in expected:
        assert text in lines[0], (text, lines[0])


@pytest.fixture
def run(tmp_path, qwen3_tokenizer) -> Path:
    out = write_run(tmp_path / "run", qwen3_tokenizer, groups=4, size=2, turns=2)
    record = json.loads((out / "run.json").read_text())
    record["budget"] = {"max_new_tokens": 32, "top_p": 1.0}
    (out / "run.json").write_text(json.dumps(record))
    with (out / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"kind": "warm_start", "policy": {"uri": "file:///x", "version": 0}}))
        f.write("\n")
    return out


def test_special_files_are_refused_not_read(run):
    good = (run / "run.json").read_text()
    (run / "run.json").unlink()
    os.mkfifo(run / "run.json")
    assert_one_line(plies_replay(run, "--group", "train-0"), "run.json is a FIFO")
    (run / "run.json").unlink()
    (run / "run.json").write_text(good)

    (run / "groups.jsonl").unlink()
    (run / "groups.jsonl").symlink_to("/dev/zero")
    assert_one_line(plies_replay(run, "--group", "train-0"), "groups.jsonl is a character device")

    (run / "groups.jsonl").unlink()
    (run / "groups.jsonl").mkdir()
    assert_one_line(plies_replay(run, "--group", "train-0"), "groups.jsonl is a directory")

    (run / "metrics.jsonl").unlink()
    os.mkfifo(run / "metrics.jsonl")
    assert_one_line(plies_replay(run, "--train-only", "--step", "0"), "metrics.jsonl is a FIFO")


def test_a_run_file_over_its_cap_is_refused(run):
    with (run / "run.json").open("r+b") as f:
        f.truncate(65 << 20)  # sparse: 65 MiB of nothing, over the cap of a one-object file
    assert_one_line(plies_replay(run, "--group", "train-0"), "run.json holds", "more than")


def test_records_of_the_wrong_types_are_one_line(run):
    good = (run / "run.json").read_text()
    (run / "run.json").write_text(json.dumps({"sampling": {"max_tokens": "many"}}))
    assert_one_line(
        plies_replay(run, "--group", "train-0"), "run.json records sampling", "max_tokens"
    )
    (run / "run.json").write_text(good)

    log = (run / "metrics.jsonl").read_text().splitlines()
    warm = json.loads(log[-1])
    warm["policy"] = {"uri": "file:///x", "version": "zero"}
    (run / "metrics.jsonl").write_text("\n".join([*log[:-1], json.dumps(warm)]) + "\n")
    assert_one_line(
        plies_replay(run, "--train-only", "--step", "0"), "not a policy record", "version"
    )

    step0 = json.loads(log[0])
    step0["groups"] = "train-0"
    odd = [json.dumps(step0), json.dumps({"kind": "step", "step": "1"}), *log[1:]]
    (run / "metrics.jsonl").write_text("\n".join(odd) + "\n")
    assert_one_line(
        plies_replay(run, "--train-only", "--step", "0"), "groups are not a list of group ids"
    )
    assert_one_line(plies_replay(run, "--train-only", "--step", "7"), "records no step 7")


def test_a_missing_groups_file_is_one_line(run):
    shutil.rmtree(run / "server", ignore_errors=True)
    (run / "groups.jsonl").unlink()
    assert_one_line(plies_replay(run, "--group", "train-0"), "groups.jsonl is missing")
