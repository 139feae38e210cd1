"""`plies demo blackjack --trainer tinker` as a subprocess, on the embedded server's Tinker API:
Ctrl-C, then the same command again, continues from the last published policy, and the
server's op journals (`STATE_DIR/tinker/<run>/ops.jsonl`) show every step applied once."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
from demo_runs import interrupt_when, records, wait

from plies import PolicyRef
from plies.recipes.blackjack import BUDGETS
from plies.testing import closed_url, plies_command
from plies.training._tinker import tinker_checkpoint

pytest.importorskip("tinker")

DEMO = plies_command("demo", "blackjack")
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TINKER_TELEMETRY": "0",
}
for _var in ("TINKER_BASE_URL", "TINKER_API_KEY"):  # the embedded server, not one from outside
    ENV.pop(_var, None)


def demo(out: Path) -> subprocess.Popen:
    log = (out.parent / f"{out.name}.log").open("ab")
    argv = [*DEMO, "--out", str(out), "--budget", "smoke", "--trainer", "tinker"]
    argv += ["--keep-policies", "1"]
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=ENV)


def runs(out: Path) -> dict[str, list[dict]]:
    """Each training run (tenant) the server holds: its op journal, in order."""
    root = out / "server" / "tinker"
    found = {}
    for journal in sorted(root.glob("*/ops.jsonl")):
        lines = journal.read_text().splitlines()
        found[journal.parent.name] = [json.loads(x) for x in lines if x.strip()]
    return found


def applied(journal: list[dict], kind: str) -> list[dict]:
    """The outcomes of the ops of `kind` that succeeded."""
    seqs = {r["seq"] for r in journal if r["event"] == "submit" and r["kind"] == kind}
    done = [r for r in journal if r["event"] == "done" and r["seq"] in seqs]
    return [r for r in done if "error" not in r.get("json", {})]


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the deadlines below bound it; the default 300 s cannot
def test_ctrl_c_then_resume_on_tinker_applies_every_step_once(tmp_path):
    out = tmp_path / "run"
    proc = demo(out)

    # The Tinker warm start is slower than the native one: a Tinker forward_backward returns
    # logprobs at every position, so the server runs the output layer over whole sequences.
    def stepped() -> bool:
        return bool(records(out, "step"))

    assert interrupt_when(proc, out, stepped, within=2400, before="its first GRPO step") == 130
    before = records(out, "step")
    last = PolicyRef.model_validate(before[-1]["policy"])
    assert last.uri.startswith("tinker://")

    rc = wait(demo(out), out, 1200)
    assert rc == 0, (tmp_path / "run.log").read_text(errors="replace")[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["trainer"] == "tinker" and summary["complete"]
    after = records(out, "step")
    assert [s["step"] for s in after] == list(range(BUDGETS["smoke"].grpo_steps))
    resumed = after[len(before)]
    published = 1 if resumed.get("loss") is not None else 0
    assert resumed["policy"]["version"] == last.version + published

    # Two training runs: the first (warm start and the steps before Ctrl-C), and the one
    # created from the checkpoint of the last policy published before it.
    journals = runs(out)
    assert len(journals) == 2, sorted(journals)
    first_ops, second_ops = sorted(journals.values(), key=lambda ops: ops[0]["kind"] != "create")
    assert first_ops[0]["kind"] == "create" and second_ops[0]["kind"] == "load_weights"
    loaded = applied(second_ops, "load_weights")
    assert [r["json"]["path"] for r in loaded] == [tinker_checkpoint(last)]

    # Every step applied exactly once along the run: the warm start and the steps logged
    # before Ctrl-C on the first model, the rest on the second; none repeated, none extra.
    trained = lambda steps: sum(s.get("loss") is not None for s in steps)  # noqa: E731
    assert len(applied(first_ops, "optim_step")) == BUDGETS["smoke"].warm_steps + trained(before)
    assert len(applied(second_ops, "optim_step")) == trained(after[len(before) :])

    # --keep-policies 1: the warm start's policy and the newest stay on the service; the
    # sampler weights of the others, from both training runs, were deleted through the API.
    logged = [r["policy"] for r in records(out, "warm_start") + after]
    uris = {p["version"]: p["uri"] for p in logged}
    kept = {logged[0]["version"], logged[-1]["version"]}
    retention = json.loads((out / "retention.json").read_text())
    assert retention["removed"] == sorted(set(uris) - kept)
    assert set(retention["kept"]) == kept
    registry = (out / "server" / "tinker" / "samplers.jsonl").read_text().splitlines()
    forgotten = [json.loads(line)["forget"] for line in registry if '"forget"' in line]
    assert sorted(forgotten) == sorted(uris[v] for v in retention["removed"])


@pytest.mark.timeout(900)  # the deadlines below bound it
def test_the_default_budget_starts_on_tinker_without_extra_flags(tmp_path):
    """`plies demo blackjack --trainer tinker` as the README gives it: the budget samples at
    top_p 1 for the Tinker API (its losses take logprobs over the whole vocabulary), the rest
    of the default budget unchanged; the warm start trains until Ctrl-C stops the run."""
    out = tmp_path / "run"
    log = (tmp_path / "run.log").open("ab")
    argv = [*DEMO, "--out", str(out), "--trainer", "tinker"]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=ENV)

    def warm_stepped() -> bool:
        return any(applied(ops, "optim_step") for ops in runs(out).values())

    rc = interrupt_when(proc, out, warm_stepped, within=600, before="its first warm-start step")
    assert rc == 130
    assert warm_stepped(), "no warm-start step"
    budget = json.loads((out / "run.json").read_text())["budget"]
    assert budget == {**dataclasses.asdict(BUDGETS["default"]), "top_p": 1.0}
    assert BUDGETS["default"].top_p < 1.0  # the native default cuts; the Tinker run does not


def test_a_tinker_service_that_is_down_misnamed_or_asked_for_top_p_is_one_line_and_exit_2(
    tmp_path,
):
    closed = closed_url()
    for extra, says in (
        (["--trainer", "tinker", "--tinker-url", closed], "no Tinker service answers"),
        (["--tinker-url", closed], "--tinker-url is the service of --trainer tinker"),
        (["--trainer", "tinker", "--set", "top_p=0.9"], "asks for top_p 0.9: leave top_p out"),
        (
            ["--trainer", "tinker", "--sampler", "batch-invariant"],
            "--sampler batch-invariant is for --trainer native",
        ),
    ):
        argv = [*DEMO, "--out", str(tmp_path / "run"), "--budget", "smoke", *extra]
        done = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=300)
        assert done.returncode == 2, done.stderr[-2000:]
        errors = [line for line in done.stderr.splitlines() if line.startswith("plies demo:")]
        assert len(errors) == 1 and says in errors[0], done.stderr[-2000:]
        assert "Traceback" not in done.stderr
