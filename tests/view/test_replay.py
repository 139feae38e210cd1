"""`plies replay` on a real demo run: recorded turns re-sampled on a fresh reference server."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from _view_runs import ENV, demo_test

from plies.runtime import JsonlSink, read_groups
from plies.testing import plies_command

TURN = re.compile(
    r"member (\d+) turn (\d+) policy v(\d+): (\d+)/(\d+) tokens, "
    r"max \|logprob difference\| (\S+): (exact|tokens equal|DIFFERENT)"
)


def plies_replay(run: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        plies_command("replay", str(run), *args),
        capture_output=True, text=True, env=ENV, timeout=600,
    )  # fmt: skip


def longest_member(run: Path) -> tuple[str, int]:
    groups = read_groups(run / "groups.jsonl").records
    return max(
        ((g.id, m) for g in groups for m in range(len(g.trajectories))),
        key=lambda gm: len(next(g for g in groups if g.id == gm[0]).trajectories[gm[1]].turns),
    )


@demo_test
def test_replay_reproduces_every_turn_of_a_recorded_group(demo_run):
    group_id, _ = longest_member(demo_run)
    group = next(g for g in read_groups(demo_run / "groups.jsonl").records if g.id == group_id)
    result = plies_replay(demo_run, "--group", group_id)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    shown = [TURN.fullmatch(line) for line in result.stdout.splitlines()[:-1]]
    assert all(shown), result.stdout
    recorded = [
        (m, k, t) for m, traj in enumerate(group.trajectories) for k, t in enumerate(traj.turns)
    ]
    assert len(shown) == len(recorded) >= 2
    for match, (m, k, turn) in zip(shown, recorded, strict=True):
        assert (int(match[1]), int(match[2]), int(match[3])) == (m, k, turn.policy.version)
        assert int(match[4]) == int(match[5]) == len(turn.completion_ids)
        assert match[7] in ("exact", "tokens equal")
        assert float(match[6]) < 1e-4
    assert result.stdout.splitlines()[-1] == f"{len(recorded)} of {len(recorded)} turns reproduced"
    print("\n" + result.stdout)


@demo_test
def test_replay_says_when_a_turn_is_not_what_was_sampled(demo_run, tmp_path):
    group_id, member = longest_member(demo_run)
    run = tmp_path / "run"
    shutil.copytree(demo_run, run, ignore=shutil.ignore_patterns("groups.jsonl"))
    groups = read_groups(demo_run / "groups.jsonl").records
    with JsonlSink(run / "groups.jsonl") as sink:
        for group in groups:
            if group.id == group_id:  # the first turn's last-but-one token, edited
                traj = group.trajectories[member]
                turn = traj.turns[0]
                ids = [*turn.completion_ids]
                ids[-2] = (ids[-2] + 1) % 1000
                turns = [turn.model_copy(update={"completion_ids": ids}), *traj.turns[1:]]
                trajs = list(group.trajectories)
                trajs[member] = traj.model_copy(update={"turns": turns})
                group = group.model_copy(update={"trajectories": trajs})
            sink.write_group(group)
    result = plies_replay(run, "--group", group_id, "--member", str(member))
    assert result.returncode == 1, result.stdout + result.stderr
    first = result.stdout.splitlines()[0]
    assert first.endswith(f"DIFFERENT, first difference at token {len(ids) - 2}"), first


@demo_test
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


@pytest.mark.anyio
async def test_seeded_policy_seeds_each_request_from_its_episode_and_prompt(policy_server):
    from plies.policy import SamplingParams, SeededPolicy, VLLMClient, turn_seed

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
