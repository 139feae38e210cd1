"""The run log reads back strictly: a crash's torn last line is cut off and reported, any
other damage is an error naming the file and line, and nothing is skipped silently."""

from __future__ import annotations

import json

import pytest

from plies import ConfigError
from plies.rl import RunLog


def test_records_written_are_read_back_in_order(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = RunLog(path)
    log.write("step", step=0, groups=["train-0"])
    log.write("step", step=1, groups=["train-1"])
    log.close()
    again = RunLog(path)
    assert again.torn_tail is None
    assert [r["step"] for r in again.all("step")] == [0, 1]
    assert again.last("step", step=0)["groups"] == ["train-0"]
    again.close()


def test_a_torn_last_line_is_cut_off_and_reported(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = json.dumps({"kind": "warm_start", "time": 1.0})
    path.write_text(good + "\n" + '{"kind": "step", "st')
    log = RunLog(path)
    assert log.torn_tail is not None and log.torn_tail.line == 2
    assert [r["kind"] for r in log.records] == ["warm_start"]
    log.write("step", step=0)
    log.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["step"] == 0  # a fresh line, nothing glued
    assert RunLog(path).torn_tail is None  # a second resume reads a clean file


@pytest.mark.parametrize(
    "damage",
    ["not json", "", '["a list"]', '{"no": "kind"}'],
    ids=["text", "empty", "list", "kindless"],
)
def test_damage_before_the_last_line_is_an_error_naming_the_line(tmp_path, damage):
    path = tmp_path / "metrics.jsonl"
    good = json.dumps({"kind": "warm_start", "time": 1.0})
    path.write_text(f"{good}\n{damage}\n{good}\n")
    with pytest.raises(ConfigError, match=r"metrics\.jsonl:2"):
        RunLog(path)
    assert path.read_text() == f"{good}\n{damage}\n{good}\n"  # left as it was
