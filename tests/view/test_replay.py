"""`plies replay` on a real demo run: recorded turns re-sampled on a fresh reference server,
recorded training steps re-fed to a trainer restored at them."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from smoke_run import ENV, demo_test

from plies import Group, Trajectory
from plies.policy import SamplingParams
from plies.runtime import JsonlSink, read_jsonl
from plies.testing import plies_command
from plies.view._replay import sampling_of

TURN = re.compile(
    r"member (\d+) turn (\d+) policy v(\d+): (\d+)/(\d+) tokens, "
    r"max \|logprob difference\| (\S+): (exact|tokens equal|LOGPROBS NOT EXACT|DIFFERENT)"
    r"(?:, first difference at token (\d+))?"
)
FIELD = re.compile(r"(\w+): recorded (.+), replayed (.+): (exact|DIFFERENT.*)")


def plies_replay(run: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        plies_command("replay", str(run), *args),
        capture_output=True, text=True, env=ENV, timeout=600,
    )  # fmt: skip


def longest_member(run: Path) -> tuple[str, int]:
    """The member with the most turns, of the groups sampled only by policies the run kept
    (its retention removed the others, and replaying those is refused)."""
    kept = set(json.loads((run / "retention.json").read_text())["kept"])
    members = [
        (len(traj.turns), g.id, m)
        for g in read_jsonl(run / "groups.jsonl", Group).records
        if {t.policy.version for traj in g.trajectories for t in traj.turns} <= kept
        for m, traj in enumerate(g.trajectories)
    ]
    _, group_id, member = max(members, key=lambda x: x[0])
    return group_id, member


@demo_test
def test_replay_reproduces_every_turn_of_a_recorded_group(demo_run):
    group_id, _ = longest_member(demo_run)
    group = next(
        g for g in read_jsonl(demo_run / "groups.jsonl", Group).records if g.id == group_id
    )
    result = plies_replay(demo_run, "--group", group_id)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    shown = [TURN.fullmatch(line) for line in result.stdout.splitlines()[:-1]]
    assert all(shown), result.stdout
    recorded = [
        (m, k, t) for m, traj in enumerate(group.trajectories) for k, t in enumerate(traj.turns)
    ]
    assert len(shown) == len(recorded) >= 2
    # The demo samples batch-invariantly and says so: every logprob must come back bit for bit.
    run = json.loads((demo_run / "run.json").read_text())
    assert run["sampler"] == {"batch_invariant": True}
    server_log = (demo_run / "server.log").read_text()
    assert set(re.findall(r"ready at \S+ serving \S+, decoding (.+)", server_log)) == {
        "each request alone"
    }
    # What replay re-samples with: the harness's own sampling, as the run recorded it.
    assert sampling_of(demo_run) == SamplingParams.model_validate(run["sampling"])
    assert (run["sampling"]["temperature"], run["sampling"]["top_p"]) == (1.0, 0.99)
    for match, (m, k, turn) in zip(shown, recorded, strict=True):
        assert (int(match[1]), int(match[2]), int(match[3])) == (m, k, turn.policy.version)
        assert int(match[4]) == int(match[5]) == len(turn.completion_ids)
        assert (match[6], match[7]) == ("0", "exact"), match[0]
    n = len(recorded)
    assert result.stdout.splitlines()[-1] == f"{n} of {n} turns reproduced exactly"
    print("\n" + result.stdout)


def _edit_first_turn(traj: Trajectory, **update) -> Trajectory:
    return traj.model_copy(
        update={"turns": [traj.turns[0].model_copy(update=update), *traj.turns[1:]]}
    )


@demo_test
def test_replay_says_when_a_turn_is_not_what_was_sampled(demo_run, tmp_path):
    group_id, member = longest_member(demo_run)
    other = (member + 1) % 2
    run = tmp_path / "run"
    shutil.copytree(demo_run, run, ignore=shutil.ignore_patterns("groups.jsonl"))
    groups = read_jsonl(demo_run / "groups.jsonl", Group).records
    with JsonlSink(run / "groups.jsonl") as sink:
        for group in groups:
            if group.id == group_id:
                trajs = list(group.trajectories)
                ids = [*trajs[member].turns[0].completion_ids]  # the last-but-one token
                ids[-2] = (ids[-2] + 1) % 1000
                trajs[member] = _edit_first_turn(trajs[member], completion_ids=ids)
                lps = [*trajs[other].turns[0].logprobs]  # a logprob, by float32 rounding
                lps[0] = float(np.nextafter(np.float32(lps[0]), np.float32(-1)))
                trajs[other] = _edit_first_turn(trajs[other], logprobs=lps)
                group = group.model_copy(update={"trajectories": trajs})
            sink.write_group(group)
    result = plies_replay(run, "--group", group_id)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    shown = [TURN.fullmatch(line) for line in lines[:-1]]
    turn = {(int(m[1]), int(m[2])): m for m in shown}
    assert (turn[member, 0][7], turn[member, 0][8]) == ("DIFFERENT", str(len(ids) - 2))
    assert turn[other, 0][7] == "LOGPROBS NOT EXACT" and 0 < float(turn[other, 0][6]) < 1e-5
    # The edited token is in the member's later prompts; the other members' are untouched.
    untouched = [m for (mem, k), m in turn.items() if mem != member and (mem, k) != (other, 0)]
    assert untouched and all(m[7] == "exact" for m in untouched), result.stdout
    n = sum(len(t.turns) for g in groups if g.id == group_id for t in g.trajectories)
    ok = sum(m[7] == "exact" for m in shown)
    assert len(shown) == n and ok <= n - 2
    assert lines[-1] == f"{ok} of {n} turns reproduced exactly"


@demo_test
def test_a_run_recorded_before_its_sampling_is_replayed_from_its_budget(tmp_path):
    """Older Blackjack runs recorded only their budget: temperature 1, the budget's token cap
    and its top_p, or the whole vocabulary for a run older than the field."""
    budget = {"max_new_tokens": 32, "top_p": 0.9}
    for recorded, top_p in ((budget, 0.9), ({"max_new_tokens": 32}, 1.0)):
        (tmp_path / "run.json").write_text(json.dumps({"budget": recorded}))
        assert sampling_of(tmp_path) == SamplingParams(max_tokens=32, temperature=1.0, top_p=top_p)
    sampling = {"max_tokens": 7, "temperature": 0.5, "top_p": 0.8}
    (tmp_path / "run.json").write_text(json.dumps({"budget": budget, "sampling": sampling}))
    assert sampling_of(tmp_path) == SamplingParams(**sampling)


def test_replay_refuses_what_the_run_does_not_hold(demo_run, tmp_path):
    result = plies_replay(demo_run, "--group", "no-such-group")
    assert result.returncode == 2
    assert result.stderr.startswith("plies replay: no group 'no-such-group' in "), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    group_id, _ = longest_member(demo_run)
    result = plies_replay(demo_run, "--group", group_id, "--member", "99")
    assert result.returncode == 2 and "not 99" in result.stderr
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(demo_run / "groups.jsonl", bare / "groups.jsonl")
    result = plies_replay(bare, "--group", group_id)
    assert result.returncode == 2 and "run.json" in result.stderr, result.stderr


def trained_steps(run: Path) -> list[dict]:
    """The run's `step` records of steps that trained (a step whose groups all tied did not)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "step" and r.get("loss") is not None]


@demo_test
def test_replay_train_only_reproduces_every_metric_a_step_recorded(demo_run):
    record = trained_steps(demo_run)[-1]
    result = plies_replay(demo_run, "--train-only", "--step", str(record["step"]))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"step {record['step']} from policy v"), lines[0]
    assert lines[0].endswith(f"groups {', '.join(record['groups'])}")
    fields = {m[1]: m for m in map(FIELD.fullmatch, lines[1:-1])}
    # The recipe records every metric the trainer reports, and each comes back bit for bit.
    for name in ("loss", "grad_norm", "kl", "ratio_mean", "logprob_diff_max", "tokens"):
        assert fields[name][4] == "exact", fields[name][0]
        assert float(fields[name][2]) == float(fields[name][3]) == record[name]
    assert fields["trainable"][2] == str(record["trainable"])
    n = len(fields)
    assert lines[-1] == f"{n} of {n} recorded fields of step {record['step']} reproduced"
    print("\n" + result.stdout)


@demo_test
def test_replay_train_only_names_what_the_run_lacks_for_a_step(demo_run, tmp_path):
    record = trained_steps(demo_run)[-1]
    step = str(record["step"])
    run = tmp_path / "run"
    shutil.copytree(demo_run, run, ignore=shutil.ignore_patterns("view*"))
    # The copy as if it had been run here, then a policy pruned (as retention may do).
    log = (demo_run / "metrics.jsonl").read_text().replace(str(demo_run), str(run))
    (run / "metrics.jsonl").write_text(log)
    records = [json.loads(line) for line in log.splitlines()]
    before = [r for r in records if r["kind"] == ("step" if record["step"] else "warm_start")]
    before = [r for r in before if r.get("step", record["step"] - 1) == record["step"] - 1]
    version = before[-1]["policy"]["version"]
    shutil.rmtree(run / "server" / "policies" / str(version))
    result = plies_replay(run, "--train-only", "--step", step)
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith(
        f"plies replay: step {step} needs the policy it began from, and policy v{version} ("
    ), result.stderr
    assert "is neither where it was published nor in" in result.stderr
    # Pruned by the run's own retention, which says so in retention.json.
    retention = {"keep_policies": 1, "kept": [], "removed": [version]}
    (run / "retention.json").write_text(json.dumps(retention))
    result = plies_replay(run, "--train-only", "--step", step)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert f"policy v{version} was not kept (the run kept --keep-policies 1" in result.stderr

    result = plies_replay(demo_run, "--train-only", "--step", "99")
    assert result.returncode == 2
    assert result.stderr.startswith("plies replay: ") and "records no step 99" in result.stderr
    with JsonlSink(run / "lacking.jsonl") as sink:
        for group in read_jsonl(demo_run / "groups.jsonl", Group).records:
            if group.id != record["groups"][-1]:
                sink.write_group(group)
    (run / "lacking.jsonl").replace(run / "groups.jsonl")
    result = plies_replay(run, "--train-only", "--step", step)
    assert result.returncode == 2
    assert f"lacks group(s) {record['groups'][-1]} that step {step} trained on" in result.stderr
    for args in (("--train-only",), ("--train-only", "--step", "0", "--group", "x"), ()):
        result = plies_replay(demo_run, *args)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, args


@pytest.mark.anyio
async def test_seeded_policy_seeds_each_request_from_its_episode_and_prompt(policy_server):
    from plies.policy import SamplingParams, SeededPolicy, VLLMClient
    from plies.policy._seeded import turn_seed

    prompt = [151644, 872, 198, 9707, 11, 1246, 525, 498, 30]
    params = SamplingParams(max_tokens=8, temperature=1.0)
    async with VLLMClient(policy_server.url, policy_server.model) as client:
        seeded = SeededPolicy(client)
        a = await seeded.sample(prompt, params, session="episode-a")
        again = await seeded.sample(prompt, params, session="episode-a")
        direct = await client.sample(
            prompt, params.model_copy(update={"seed": turn_seed("episode-a", len(prompt))})
        )
        others = [
            (await seeded.sample(prompt, params, session=f"episode-{i}")).ids for i in range(6)
        ]
        given = params.model_copy(update={"seed": 7})
        kept = await seeded.sample(prompt, given, session="episode-a")
        seven = await client.sample(prompt, given)
    assert a.ids == again.ids == direct.ids and a.logprobs == direct.logprobs
    assert len({tuple(ids) for ids in others}) > 1  # episodes draw independently
    assert kept.ids == seven.ids  # a seed the caller chose is left alone
    assert turn_seed("episode-a", 9) != turn_seed("episode-a", 10) < 2**31


async def _alone_and_crowded(url: str, model: str) -> tuple[list, list]:
    """Seeded requests of different lengths, each sent alone, then all at once."""
    import anyio

    from plies.policy import SamplingParams, VLLMClient

    prompts = [[151644, 872, 198] + [1000 + 37 * i + j for j in range(3 + 5 * i)] for i in range(8)]
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=100 + i) for i in range(8)]
    async with VLLMClient(url, model) as client:
        alone = [await client.sample(p, s) for p, s in zip(prompts, params, strict=True)]
        crowded: list = [None] * len(prompts)

        async def one(i: int) -> None:
            crowded[i] = await client.sample(prompts[i], params[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
    return alone, crowded


@pytest.mark.parametrize("invariant", [True, False], ids=["batch-invariant", "batched"])
def test_a_batch_invariant_server_samples_a_request_alike_alone_and_in_a_crowd(
    invariant, start_policy_server, tiny_model_dir, tmp_path
):
    import anyio

    args = ("--batch-invariant",) if invariant else ()
    with start_policy_server(tiny_model_dir, tmp_path / "state", *args) as server:
        alone, crowded = anyio.run(_alone_and_crowded, server.url, server.model)
    assert [a.ids for a in alone] == [c.ids for c in crowded]  # seeded: tokens never differ
    same = [a.logprobs == c.logprobs for a, c in zip(alone, crowded, strict=True)]
    if invariant:
        assert all(same), same
    else:  # the premise of the mode: shared batches do round differently
        assert not all(same), "batched logprobs matched bit for bit; is the mode still needed?"
