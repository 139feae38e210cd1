"""`plies doctor` on real tokenizer directories, through the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import trl
from transformers import AutoTokenizer
from typer.testing import CliRunner

from plies.cli import app


def _doctor(path: Path, *extra: str) -> dict:
    result = CliRunner().invoke(app, ["doctor", str(path), "--json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout[result.stdout.index("{") :])


def test_doctor_qwen3_default(qwen3_tokenizer_dir):
    report = _doctor(qwen3_tokenizer_dir)
    assert report["close_token"] == "<|im_end|>" and report["close_token_id"] == 151645
    assert report["reasoning_stripped_from_history"] is True
    assert report["prefix_preserving"] is False
    assert report["tool_calling_supported"] is True
    assert report["response_schema"] == "trl"
    assert len(report["template_key"]) == 64
    assert set(report["transitions"]) == {"tool_round", "user_turn", "user_turn_after_reasoning"}
    nothink = _doctor(qwen3_tokenizer_dir, "--kwarg", "enable_thinking=false")
    assert nothink["template_kwargs"] == {"enable_thinking": False}
    assert nothink["template_key"] != report["template_key"]
    assert "prefill_dropped" in nothink["transitions"]["tool_round"]["renderer_will"]


def test_doctor_training_template_is_incremental(qwen3_tokenizer_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    tok.chat_template = (
        Path(trl.__file__).parent / "chat_templates" / "qwen3_training.jinja"
    ).read_text()
    tok.save_pretrained(tmp_path)
    report = _doctor(tmp_path)
    assert report["prefix_preserving"] is True
    assert report["reasoning_stripped_from_history"] is False
    assert report["stop_token_in_assistant_span"] is True
    assert {v["renderer_will"] for v in report["transitions"].values()} == {"incremental"}


def test_doctor_rejects_a_missing_directory(tmp_path):
    result = CliRunner().invoke(app, ["doctor", str(tmp_path / "nope"), "--json"])
    assert result.exit_code == 2
    assert "not a directory" in result.output
