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
    model, training = report["templates"]["model"], report["templates"]["training"]
    assert model["name"] == "qwen3" and training["name"] == "qwen3_training"
    assert model["close_token"] == "<|im_end|>" and model["close_token_id"] == 151645
    assert model["reasoning_stripped_from_history"] is True
    assert model["prefix_preserving"] is False
    assert model["tool_calling_supported"] is True
    assert model["response_schema"] == "trl"
    assert len(model["template_key"]) == 64
    assert set(model["transitions"]) == {"tool_round", "user_turn", "user_turn_after_reasoning"}
    # The variant keeps history as sampled: every probe transition is incremental.
    assert training["prefix_preserving"] is True
    assert training["reasoning_stripped_from_history"] is False
    assert training["stop_token_in_assistant_span"] is True
    assert {v["renderer_will"] for v in training["transitions"].values()} == {"incremental"}
    assert report["auto"]["uses"] == "training" and "prefix-preserving" in report["auto"]["reason"]
    assert report["recommended"] == "training"

    nothink = _doctor(qwen3_tokenizer_dir, "--kwarg", "enable_thinking=false")
    assert nothink["template_kwargs"] == {"enable_thinking": False}
    no_model = nothink["templates"]["model"]
    assert no_model["template_key"] != model["template_key"]
    assert all("prefill_dropped" in v["renderer_will"] for v in no_model["transitions"].values())
    assert nothink["templates"]["training"]["transitions"]["user_turn"]["renderer_will"] == (
        "incremental"
    )
    assert (
        nothink["recommended"] == "training" and "0 with the model's" in nothink["recommendation"]
    )


def test_doctor_training_template_is_its_own_variant(qwen3_tokenizer_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    tok.chat_template = (
        Path(trl.__file__).parent / "chat_templates" / "qwen3_training.jinja"
    ).read_text()
    tok.save_pretrained(tmp_path)
    report = _doctor(tmp_path)
    assert report["auto"] == {
        "uses": "model",
        "name": "qwen3_training",
        "reason": "the model's template is TRL's training variant already",
    }
    assert report["templates"]["training"]["name"] == "qwen3_training"
    assert report["recommended"] == "model"


def test_doctor_without_a_training_variant(qwen3_tokenizer_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "gemma4.jinja").read_text()
    tok.save_pretrained(tmp_path)
    report = _doctor(tmp_path)
    assert report["templates"]["training"] is None
    assert "no training variant" in report["training_problem"]
    assert report["auto"]["uses"] == "model" and report["recommended"] == "model"
    result = CliRunner().invoke(app, ["doctor", str(tmp_path)])  # the tables, not JSON
    assert result.exit_code == 0, result.output
    assert "recommended: template='model'" in result.output


def test_doctor_rejects_a_missing_directory(tmp_path):
    result = CliRunner().invoke(app, ["doctor", str(tmp_path / "nope"), "--json"])
    assert result.exit_code == 2
    assert "not a directory" in result.output


def test_doctor_on_a_directory_without_a_tokenizer_is_one_line(tmp_path):
    """A folder that holds no tokenizer (`plies doctor docs`): one line and exit 2, no traceback."""
    import subprocess

    from plies.testing import plies_command

    (tmp_path / "notes.md").write_text("no tokenizer here\n")
    for folder in (tmp_path, Path(__file__).parents[2] / "docs"):
        result = subprocess.run(
            plies_command("doctor", str(folder)), capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 2, result.stderr[-2000:]
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert lines[0].startswith(f"plies doctor: {folder} holds no tokenizer that loads")
