"""`plies demo blackjack` end to end as a subprocess: a short run, and Ctrl-C then resume."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path

import pytest
import smoke_run
from demo_runs import interrupt_when, records, wait

from plies import Group
from plies.environments.blackjack_exact import REFERENCES, expected_return, on_deals, price_record
from plies.recipes.blackjack import BUDGETS
from plies.recipes.blackjack.config import (
    DEFAULT_KEEP_POLICIES,
    EVAL_SEEDS,
    RUN_SEEDS,
    SEED_STRIDE,
    TRAIN_SEEDS,
)
from plies.recipes.blackjack.grpo import train_tasks
from plies.runtime import read_jsonl
from plies.testing import plies_command

DEMO = plies_command("demo", "blackjack")


def demo(out: Path, *args: str) -> subprocess.Popen:
    log = (out.parent / f"{out.name}.log").open("ab")
    return subprocess.Popen(
        [*DEMO, "--out", str(out), "--budget", "smoke", *args],
        stdout=log, stderr=subprocess.STDOUT, env=smoke_run.ENV,
    )  # fmt: skip


@pytest.mark.slow
@smoke_run.demo_test
def test_short_demo_writes_metrics_summary_and_curve(demo_run):
    """The session's smoke run (`smoke_run.ARGS`): numbers changed by `--set` (the run
    does, and records, that), two GRPO policies kept."""
    out = demo_run
    log = (out.parent / smoke_run.LOG).read_text(errors="replace")
    recorded = json.loads((out / "run.json").read_text())["budget"]
    smoke = dataclasses.asdict(BUDGETS["smoke"])
    assert recorded == {**smoke, "curve_hands": 8, "top_p": 0.99}
    # The warm start: its steps at warm_lr, each applied once.
    warm_lrs = [
        line["result"]["metrics"]["lr"]
        for line in map(json.loads, (out / "server/trainer/journal.jsonl").open())
        if line["kind"] == "optim_step" and line["op_id"].startswith("warm-")
    ]
    assert warm_lrs == [smoke["warm_lr"]] * smoke["warm_steps"]
    summary = json.loads((out / "summary.json").read_text())
    for key in ("warm_start_return", "final_return", "eval_hands", "minutes", "policies"):
        assert summary[key] is not None, key
    assert summary["complete"] and summary["grpo_steps"] == 3
    evals = {r["label"]: r for r in records(out, "eval")}
    assert summary["eval_hands"] + evals["final"]["failed"] == 32
    assert evals["warm_start"]["policy"] == 1 and evals["warm_start"]["episodes"] == 32
    assert evals["final"]["return"] == summary["final_return"]
    # The curve's evaluation (every 2 steps) plays the `--set` number of hands.
    assert [(r["step"], r["episodes"]) for r in records(out, "eval") if r["label"] == "curve"] == [
        (2, 8)
    ]
    steps = records(out, "step")
    assert [s["step"] for s in steps] == [0, 1, 2]
    # Nucleus sampling, in the sampler and in the trainer: a token alone in its nucleus was
    # drawn with logprob exactly 0; step 0's groups were sampled by the policy it trains, so
    # the trainer's logprobs are the sampler's only if it cuts at the same top_p.
    sampled = [lp for g in read_jsonl(out / "groups.jsonl", Group).records for t in g.trajectories
               for turn in t.turns for lp in turn.logprobs]  # fmt: skip
    assert sampled.count(0.0) > len(sampled) / 2
    assert steps[0]["logprob_diff_max"] < 1e-4
    published = {s["policy"]["version"] for s in steps} | {1}
    assert summary["policies"] == len(published)
    for figure in ("learning_curve.png", "strategy.png"):
        assert (out / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", figure
    # The paired comparison: both evaluations played the same 32 deals, hand by hand.
    low, high = summary["final_ci95"]
    assert low <= summary["final_return"] <= high
    pairs = [
        (a, b)
        for a, b in zip(evals["warm_start"]["rewards"], evals["final"]["rewards"], strict=True)
        if a is not None and b is not None
    ]
    assert summary["paired_hands"] == len(pairs) >= 30
    mean = sum(b - a for a, b in pairs) / len(pairs)
    assert summary["improvement"] == pytest.approx(mean, abs=1e-4)
    low, high = summary["improvement_ci95"]
    assert low <= summary["improvement"] <= high
    # The strategy grid counts exactly the final evaluation's decisions.
    cells = [c for kind in ("hard", "soft") for row in summary["strategy"][kind].values()
             for c in row.values()]  # fmt: skip
    assert sum(c["decisions"] for c in cells) == len(evals["final"]["decisions"]) > 0
    groups = read_jsonl(out / "groups.jsonl", Group)
    assert groups.clean
    trained = {g for s in steps for g in s["groups"]}
    assert trained <= {g.id for g in groups.records}
    # --keep-policies 2: the base model, the warm start's policy and the newest two stay.
    newest = steps[-1]["policy"]["version"]
    retention = json.loads((out / "retention.json").read_text())
    on_disk = sorted(int(p.name) for p in (out / "server" / "policies").iterdir())
    assert on_disk == retention["kept"] == [0, 1, newest - 1, newest]
    assert retention["removed"] == list(range(2, newest - 1)) != []
    assert summary["disk_mb"] > 0
    # The headline: each evaluation's decisions (and forfeits) priced exactly, with intervals.
    for label in ("warm_start", "final"):
        priced = price_record(evals[label])
        assert priced.decisions == len(evals[label]["decisions"]) + len(evals[label]["forfeits"])
        assert summary[f"{label}_exact"] == pytest.approx(priced.value, abs=1e-4)
        low, high = summary[f"{label}_exact_ci95"]
        assert low < summary[f"{label}_exact"] < high
    gain = summary["final_exact"] - summary["warm_start_exact"]
    assert summary["improvement_exact"] == pytest.approx(gain, abs=2e-4)
    # ...beside what the 32 deals paid the references, and their exact values.
    scored = [EVAL_SEEDS + i for i, r in enumerate(evals["final"]["rewards"]) if r is not None]
    for name, policy in REFERENCES.items():
        assert summary["references_on_held_out"][name] == pytest.approx(
            on_deals(policy, scored), abs=1e-4
        )
        assert summary["references"][name] == pytest.approx(expected_return(policy), abs=1e-4)
    # The terminal ends with the result: exact values first, then the sampled returns with
    # the references on the same deals, the files, how to look.
    tail = log.rstrip().splitlines()[-8:]
    assert tail[0].split()[0] == "result"  # the rule above the result
    assert tail[1].startswith(f"priced exactly, per hand: final {summary['final_exact']:+.3f}")
    assert "95% CI" in tail[1] and "references random -0.396" in tail[1]
    assert tail[2].startswith("improvement on the warm start, priced exactly: ")
    assert tail[3].startswith("sampled on ") and "the same deals played by random" in tail[3]
    assert tail[4].startswith("sampled improvement ") and "paired on" in tail[4]
    assert f"plies view {out}" in tail[-2]
    assert tail[-1].startswith(f"wrote in {out}: summary.json")
    assert "it/s]" not in log and "Warning" not in log  # no tqdm bar, no library warning


@pytest.mark.slow
@pytest.mark.timeout(1300)  # the waits below bound it; the default 300 s cannot
def test_ctrl_c_then_resume_continues_from_the_last_published_policy(tmp_path):
    """Ctrl-C lands in the learning curve's evaluation after step 2, with GRPO's groups in
    flight: both drain, the run exits 130 with the resume hint, and the resumed run evaluates
    that curve point before it trains on."""
    out = tmp_path / "run"
    # The curve's evaluation on 200 hands takes a few seconds: time for Ctrl-C to land in it.
    longer_curve = ("--set", "curve_hands=200")
    proc = demo(out, *longer_curve)

    def curve_due() -> bool:  # the smoke budget evaluates the curve after every 2nd step
        return len(records(out, "step")) >= 2

    rc = interrupt_when(
        proc, out, curve_due, within=900, before="its second GRPO step was published", poll=0.05
    )
    assert rc == 130
    said = (tmp_path / "run.log").read_text(errors="replace")
    assert "interrupted: run the same command again to resume" in said
    assert "ExceptionGroup" not in said and "Traceback" not in said, said[-3000:]
    assert not [r for r in records(out, "eval") if r["label"] == "curve"], "after the curve"
    before = records(out, "step")
    assert len(before) == 2, "the interrupt came during the curve's evaluation"
    last = before[-1]["policy"]
    batches_before = _batches(out)  # steps, and batches that trained nothing (`skipped`)
    # Groups set aside as they arrived (tied, or refused) are used up too.
    used = {g for r in batches_before + records(out, "set_aside") for g in r["groups"]}
    completed = [g.id for g in read_jsonl(out / "groups.jsonl", Group).records]
    untrained = [g for g in completed if g not in used]

    rc = wait(demo(out, *longer_curve), out, 900)
    assert rc == 0, (tmp_path / "run.log").read_text(errors="replace")[-3000:]
    curve = [(r["step"], r["policy"]) for r in records(out, "eval") if r["label"] == "curve"]
    assert curve == [(2, last["version"])]
    after = records(out, "step")
    assert [s["step"] for s in after] == list(range(len(after)))  # none repeated, none skipped
    assert len(after) > len(before), (tmp_path / "run.log").read_text(errors="replace")[-3000:]
    resumed = after[len(before)]
    # Trained on top of `last`; a batch that trained nothing is not a step, so every step
    # record trained and published.
    assert resumed.get("loss") is not None
    assert resumed["policy"]["version"] == last["version"] + 1
    if untrained:  # completed before the interrupt, taken first after it
        first = _batches(out)[len(batches_before)]
        assert first["groups"] == untrained[: len(first["groups"])]
    if len(untrained) >= 2:  # a batch's worth (the smoke budget's): trained before sampling on
        aside = [r for r in records(out, "set_aside") if r["time"] > before[-1]["time"]]
        assert all(r["time"] > first["time"] for r in aside), aside
    for group in read_jsonl(out / "groups.jsonl", Group).records:
        if group.id not in completed:
            assert group.policy.version >= last["version"]
    assert json.loads((out / "summary.json").read_text())["complete"]
    _replays_its_tokens(out)


def _replays_its_tokens(out: Path) -> None:
    """A run of the default, batched sampler: `plies replay` gets a group's tokens back, and
    its logprobs to float32 rounding (another batch rounds a row otherwise)."""
    assert json.loads((out / "run.json").read_text())["sampler"] == {"batch_invariant": False}
    # ...and the server it started did decode batched (each start says how).
    server_log = (out / "server.log").read_text()
    starts = re.findall(r"ready at \S+ serving \S+, decoding (.+)", server_log)
    assert starts and set(starts) == {"batched"}, starts
    kept = set(json.loads((out / "retention.json").read_text())["kept"])
    group = next(
        g
        for g in read_jsonl(out / "groups.jsonl", Group).records
        if {t.policy.version for traj in g.trajectories for t in traj.turns} <= kept
    )
    done = subprocess.run(
        plies_command("replay", str(out), "--group", group.id),
        capture_output=True, text=True, env=smoke_run.ENV, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    *turns, total = done.stdout.strip().splitlines()
    n = sum(len(traj.turns) for traj in group.trajectories)
    assert len(turns) == n and total == f"{n} of {n} turns reproduced", done.stdout
    for line in turns:
        difference, same = line.rsplit("max |logprob difference| ", 1)[1].split(": ")
        assert same in ("exact", "tokens equal") and float(difference) < 1e-4, line


def _batches(out: Path) -> list[dict]:
    """Every GRPO batch taken, in order: steps, and those that trained nothing."""
    return sorted(records(out, "step") + records(out, "skipped"), key=lambda r: r["time"])


def _journal(out: Path) -> list[dict]:
    """The reference trainer's op journal: one line per op it applied, in order."""
    path = out / "server" / "trainer" / "journal.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]


def _warm_step(op_id: str) -> int:
    return int(op_id.split("-")[1])  # warm-<step>-fb, warm-<step>-redo<k>-fb, warm-<step>-opt


@pytest.mark.slow
@pytest.mark.timeout(1300)  # the waits below bound it; the default 300 s cannot
def test_ctrl_c_in_the_warm_start_then_resume_continues_from_its_last_applied_step(tmp_path):
    out = tmp_path / "run"
    proc = demo(out)

    def optim_steps() -> list[dict]:
        return [r for r in _journal(out) if r["kind"] == "optim_step"]

    def five_taken() -> bool:
        return len(optim_steps()) >= 5

    rc = interrupt_when(proc, out, five_taken, within=900, before="its warm start took 5 steps")
    assert rc == 130
    assert not records(out, "warm_start"), "the warm start finished before the interrupt"
    applied = [r["op_id"] for r in optim_steps()]
    done = len(applied)
    assert applied == [f"warm-{k}-opt" for k in range(done)]
    first_generation = max(r["generation"] for r in _journal(out))
    current = out / "server" / "trainer" / "checkpoints" / "CURRENT"
    checkpointed = int(current.read_text()) if current.exists() else 0

    rc = wait(demo(out), out, 900)
    log = (tmp_path / "run.log").read_text(errors="replace")
    assert rc == 0, log[-3000:]
    if checkpointed < done:  # the steps since the trainer's checkpoint were redone, not lost
        server_log = (out / "server.log").read_text(errors="replace")
        assert f"redid steps {checkpointed + 1}-{done} from their journaled batches" in server_log
    assert [r["step"] for r in records(out, "warm_resume")] == [done]
    assert f"warm start: resuming at step {done} of" in log
    # The resumed run sent no step the first had applied: every op it sent is a later one.
    later = [r for r in _journal(out) if r["generation"] > first_generation]
    warm_ops = [r["op_id"] for r in later if r["op_id"].startswith("warm-")]
    assert warm_ops and min(_warm_step(op) for op in warm_ops if op != "warm-save") == done
    # ...and every warm-start step was applied exactly once across both runs.
    opts = [r["op_id"] for r in optim_steps() if r["op_id"].startswith("warm-")]
    assert opts == [f"warm-{k}-opt" for k in range(BUDGETS["smoke"].warm_steps)]
    assert json.loads((out / "summary.json").read_text())["complete"]


def _made_run(out: Path, budget: str) -> None:
    """A run directory as `--budget BUDGET` leaves it once it has started."""
    out.mkdir(parents=True)
    key = {
        "budget": budget, "env": "local", "sandbox": "none", "trainer": "native",
        "sampler": "batched",
    }  # fmt: skip
    saved = {"config": key, "budget": dataclasses.asdict(BUDGETS[budget])}
    (out / "run.json").write_text(json.dumps(saved))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*DEMO, *args], capture_output=True, text=True, env=smoke_run.ENV, timeout=120
    )  # fmt: skip


def test_a_failure_met_while_running_is_one_line_and_exit_1_and_the_run_is_kept(tmp_path):
    """A damaged trainer state: the server refuses to open its trainer, and the demo stops."""
    out = tmp_path / "run"
    _made_run(out, "smoke")
    saved = (out / "run.json").read_text()
    journal = out / "server" / "trainer" / "journal.jsonl"
    journal.parent.mkdir(parents=True)
    journal.write_text("not a record\n")
    done = _cli("--out", str(out), "--budget", "smoke")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    line = done.stderr.strip().splitlines()[-1]  # after the resume's progress lines
    assert line.startswith("plies demo: stopped: trainer answered HTTP 503")
    assert "journal.jsonl:1 is not a journal record" in line
    assert (out / "run.json").read_text() == saved
    assert journal.read_text() == "not a record\n"


def test_the_full_demo_after_the_quick_one_in_the_same_dir_says_what_to_do(tmp_path):
    """The README's order: the quick budget, then the default one with the same --out."""
    out = tmp_path / "blackjack"
    _made_run(out, "quick")
    done = _cli("--out", str(out))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr  # one line, no traceback
    line = lines[0]
    assert "--budget quick, not --budget default" in line
    assert f"--out {out}-default" in line and "--fresh" in line
    assert json.loads((out / "run.json").read_text())["config"]["budget"] == "quick"


def test_a_run_resumed_with_the_other_sampler_is_refused_in_one_line(tmp_path):
    """A run's turns are sampled one way throughout, or `plies replay` could not say how
    exact each one is; a run recorded before `--sampler` resumes as it sampled."""
    out = tmp_path / "run"
    _made_run(out, "smoke")  # batched, the default
    done = _cli("--out", str(out), "--budget", "smoke", "--sampler", "batch-invariant")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "--sampler batched, not --sampler batch-invariant" in done.stderr
    assert "resume it with --sampler batched" in done.stderr

    older = tmp_path / "older"
    _made_run(older, "smoke")
    saved = json.loads((older / "run.json").read_text())
    del saved["config"]["sampler"]
    saved["sampler"] = {"batch_invariant": True}  # what every run sampled by before
    (older / "run.json").write_text(json.dumps(saved))
    done = _cli("--out", str(older), "--budget", "smoke")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "resume it with --sampler batch-invariant" in done.stderr
    assert json.loads((older / "run.json").read_text()) == saved


def test_a_budget_whose_numbers_changed_is_refused_in_one_line(tmp_path):
    out = tmp_path / "run"
    _made_run(out, "smoke")
    saved = json.loads((out / "run.json").read_text())
    saved["budget"]["grpo_steps"] += 1
    (out / "run.json").write_text(json.dumps(saved))
    done = _cli("--out", str(out), "--budget", "smoke")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "grpo_steps differ: grpo_steps=4 then, 3 now" in done.stderr
    assert "--set" in done.stderr and "--fresh" in done.stderr


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ("nope=1", "--set nope: not a budget field; known: warm_hands,"),
        ("lr", "--set 'lr': write FIELD=VALUE"),
        ("grpo_steps=2.5", "--set grpo_steps=2.5: grpo_steps takes int values"),
        ("lr=nan", "budget field lr is nan: a finite number > 0"),
        ("warm_lr=-1", "budget field warm_lr is -1.0: a finite number > 0"),
        ("group_size=1", "budget field group_size is 1: at least 2"),
        ("loss=adam", "budget field loss is 'adam'; known: importance_sampling, ppo"),
        ("warm_players=dealer", "budget field warm_players is 'dealer'; known: random, thr"),
        ("advantages=group", "--set advantages: not a budget field; known: warm_hands,"),
        ("curve_every=-1", "budget field curve_every is -1: at least 0"),
        ("top_p=0", "budget field top_p is 0.0: a finite number > 0"),
        ("top_p=1.5", "budget field top_p is 1.5: a share above 0, at most 1"),
    ],
)
def test_set_names_what_is_wrong_in_one_line_before_any_work(tmp_path, setting, said):
    done = _cli("--out", str(tmp_path / "run"), "--budget", "smoke", "--set", setting)
    assert done.returncode == 2 and said in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("value", "said"),
    [("0", "keep at least 1"), ("some", "a number or 'all'")],
)
def test_keep_policies_takes_a_positive_number_or_all(tmp_path, value, said):
    done = _cli("--out", str(tmp_path / "run"), "--keep-policies", value)
    assert done.returncode == 2 and said in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "run").exists()  # refused before any work


@pytest.mark.parametrize("value", ["100", "-1"])
def test_a_seed_out_of_range_is_one_line_before_any_work(tmp_path, value):
    done = _cli("--out", str(tmp_path / "run"), "--seed", value)
    assert done.returncode == 2, done.stderr
    assert f"--seed {value}: a whole number from 0 to 99" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "run").exists()


def test_a_run_resumes_only_with_the_seed_it_was_made_with(tmp_path):
    out = tmp_path / "run"
    _made_run(out, "smoke")  # recorded before --seed existed: it drew seed 0's deals
    saved = (out / "run.json").read_text()
    done = _cli("--out", str(out), "--budget", "smoke", "--seed", "3")
    assert done.returncode == 2, done.stderr
    assert f"{out} holds a run made with --seed 0, not --seed 3" in done.stderr
    assert (out / "run.json").read_text() == saved


def test_each_seed_trains_on_deals_of_its_own_and_seed_0_on_the_recorded_ones():
    assert (train_tasks(0)(5).id, train_tasks(0)(5).seed) == ("train-5", TRAIN_SEEDS + 5)
    deals = {
        seed: {train_tasks(seed)(i).seed for i in (0, 1, SEED_STRIDE - 1)}
        for seed in range(RUN_SEEDS)
    }
    every = [d for seeds in deals.values() for d in seeds]
    assert len(set(every)) == len(every)  # no deal shared between two seeds
    assert max(every) < EVAL_SEEDS  # nor with the held-out deals
    assert train_tasks(3)(5).id != train_tasks(0)(5).id  # and so other sampling seeds


def test_keep_policies_defaults_to_the_recipes_default():
    from typer.main import get_command

    from plies.cli import app

    demo_command = get_command(app).commands["demo"].commands["blackjack"]
    option = next(p for p in demo_command.params if p.name == "keep_policies")
    assert option.default == str(DEFAULT_KEEP_POLICIES)


def test_fresh_refuses_a_directory_that_holds_no_run(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("not a run")
    done = _cli("--out", str(out), "--fresh")
    assert done.returncode == 2 and "holds files but no run.json" in done.stderr
    assert (out / "notes.txt").read_text() == "not a run"
