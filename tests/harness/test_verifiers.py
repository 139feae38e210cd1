"""verifiers environments played as plies episodes: `VerifiersHarness` and its sidecar.

The environment (`verifiers_envs/adder.py`) is built from verifiers' own classes: a
`vf.ToolEnv` with one tool, a `vf.Rubric`, an in-memory dataset. verifiers itself (from
PyPI, pinned by `.ci/verifiers-tier`) runs in the sidecar's interpreter, named by
`PLIES_VERIFIERS_PYTHON`; without it these tests skip. Its model calls go through verifiers'
own OpenAI client into a real plies gateway, on the tiny random model or on a scripted
policy that answers in Qwen3's own tool-call format through the real tokenizer.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from event_script import EventScript

from plies import ConfigError, EnvError, Group, PolicyRef, Status
from plies.gateway import Gateway, GatewayServer
from plies.harness import VerifiersHarness
from plies.policy import SamplingParams, VLLMClient
from plies.runtime import RolloutDriver, RolloutResources, read_jsonl
from plies.testing import ScriptedPolicy
from plies.testing._scripted import SCRIPTED_POLICY
from plies.tokens import ChatRenderer

pytestmark = [pytest.mark.anyio, pytest.mark.verifiers]

ADDER = Path(__file__).parent / "verifiers_envs" / "adder.py"
SUMMARY = "Summary: you asked the add tool; now say the sum."  # what adder.py rewrites to


@pytest.fixture(scope="module")
def vf_python() -> str:
    python = os.environ.get("PLIES_VERIFIERS_PYTHON")
    if not python or not Path(python).exists():
        pytest.skip(
            "PLIES_VERIFIERS_PYTHON names no interpreter with verifiers (.ci/verifiers-tier)"
        )
    return python


def ask_add(prompt: str) -> dict:
    a, b = re.findall(r"What is (\d+) \+ (\d+)\?", prompt)[-1]
    return {"tool_calls": [{"name": "add", "arguments": {"a": int(a), "b": int(b)}}]}


def say_sum(prompt: str) -> str:
    [*_, total] = re.findall(r"<tool_response>\s*(\d+)\s*</tool_response>", prompt)
    return f"The sum is {total}"


def process_group(pgid: int) -> list[int]:
    """Live processes in the process group `pgid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def template_view(messages: list[dict]) -> list[dict]:
    """OpenAI-format messages as the chat template reads them (arguments as objects)."""
    view = []
    for m in messages:
        out = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("tool_calls"):
            out["tool_calls"] = [
                {
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": json.loads(c["function"]["arguments"]),
                    },
                }
                for c in m["tool_calls"]
            ]
        view.append(out)
    return view


@asynccontextmanager
async def served(
    policy: ScriptedPolicy,
    env: Path,
    vf_python: str,
    *,
    max_tokens: int = 128,
    env_args: dict[str, Any] | None = None,
) -> AsyncIterator[tuple[Gateway, VerifiersHarness]]:
    """`env` in a verifiers sidecar whose model calls reach `policy` through a real gateway,
    rendered by the tokenizer's own template (the one verifiers' messages are checked with)."""
    renderer = ChatRenderer(policy.tokenizer, template="model")
    async with (
        Gateway(policy, renderer, sampling=SamplingParams(max_tokens=max_tokens)) as gateway,
        GatewayServer(gateway) as server,
        VerifiersHarness(server, env, python=vf_python, env_args=env_args) as harness,
    ):
        yield gateway, harness


async def play(harness: VerifiersHarness, specs, policy: PolicyRef, *, cancel_after=None):
    """Admit `specs`, collect the groups (cancelling the driver when `cancel_after` fires)."""
    async with (
        RolloutResources(sampler=harness.sampler, pools=[harness.pool()]) as resources,
        RolloutDriver(resources, harness.play, policy=policy) as driver,
    ):
        for spec in specs:
            await driver.admit(spec)
        driver.close_admission()
        if cancel_after is not None:
            await cancel_after()
            driver.cancel()
        with anyio.fail_after(120):
            groups = [g async for g in driver.groups()]
        stats = driver.statistics()
    return groups, stats, resources.statistics()


async def test_a_tool_env_group_is_scored_by_its_rubric_with_exact_tokens(
    vf_python, qwen3_tokenizer
):
    policy = ScriptedPolicy(qwen3_tokenizer, [ask_add, say_sum])
    async with served(policy, ADDER, vf_python) as (gateway, harness):
        assert harness.ready["environment"] == "AdderEnv"
        rows = await harness.dataset()
        assert [r["answer"] for r in rows] == ["5", "11", "25"]
        groups, stats, resources = await play(
            harness, harness.groups(rows[:2], size=3), SCRIPTED_POLICY
        )
        assert gateway.open_sessions == 0

    assert stats.settled == {**dict.fromkeys(Status, 0), Status.COMPLETED: 6}
    assert resources.pools[0].released == 6 and resources.pools[0].quarantined == 0
    by_task = {g.task_id: g for g in groups}  # groups come out as they complete
    for row in rows[:2]:
        group = by_task[f"example-{row['example_id']}"]
        assert group.complete and len(group.trajectories) == 3
        for traj in group.trajectories:
            assert traj.status is Status.COMPLETED and traj.reward == 1.0
            assert traj.metrics["verifiers.correct"] == 1.0
            assert traj.info["verifiers"]["stop_condition"] == "no_tools_called"
            messages = traj.info["verifiers"]["messages"]
            assert messages[-1]["content"] == f"The sum is {row['answer']}"
            # Each turn's prompt is the full render of the messages verifiers sent for it.
            assistants = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
            assert len(traj.turns) == len(assistants) == 2
            tools = traj.info["verifiers"]["tools"]
            assert [t["function"]["name"] for t in tools] == ["add"]
            for k, at in enumerate(assistants):
                full = gateway.renderer.start(template_view(messages[:at]), tools=tools).render()
                assert traj.prompt_ids(k) == full
            assert [t.extends for t in traj.turns] == [False, True]
            assert [t.fallback for t in traj.turns] == [None, None]
            # One training segment: the mask is 1 exactly on the sampled ids.
            [segment] = traj.segments()
            sampled = sum(len(t.completion_ids) for t in traj.turns)
            assert sum(segment.mask) == sampled
            assert segment.tokens[-len(traj.turns[-1].completion_ids) :] == (
                traj.turns[-1].completion_ids
            )


async def test_the_tiny_random_model_scores_zero_and_leaves_nothing(
    vf_python, policy_server, tiny_model_dir
):
    from transformers import AutoTokenizer

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_dir))
    async with (
        VLLMClient(policy_server.url, policy_server.model) as client,
        Gateway(client, renderer, sampling=SamplingParams(max_tokens=12, seed=0)) as gateway,
        GatewayServer(gateway) as server,
    ):
        async with VerifiersHarness(server, ADDER, python=vf_python) as harness:
            rows = await harness.dataset(n=1)
            process = harness._process
            groups, stats, resources = await play(
                harness,
                harness.groups(rows, size=2),
                PolicyRef.model_validate(policy_server.policy),
            )
        assert process is not None and process.returncode is not None  # the sidecar is gone
        assert gateway.open_sessions == 0
    assert stats.settled_total == 2 and stats.quarantined == 0
    [group] = groups
    for traj in group.trajectories:
        assert traj.status in (Status.COMPLETED, Status.TRUNCATED)
        assert traj.reward == 0.0
        assert len(traj.turns) >= 1 and all(len(t.completion_ids) <= 12 for t in traj.turns)
        assert traj.turns[0].logprobs and all(lp <= 0.0 for lp in traj.turns[0].logprobs)
    assert resources.pools[0].live == 0 and resources.pools[0].quarantined == 0


async def test_cancelling_the_driver_runs_verifiers_cleanup_and_keeps_whole_records(
    vf_python, qwen3_tokenizer, tmp_path
):
    log = tmp_path / "cleanups.log"
    policy = ScriptedPolicy(qwen3_tokenizer, [ask_add, say_sum])
    args = {"cleanup_log": str(log), "tool_delay_s": 60.0}
    async with served(policy, ADDER, vf_python, env_args=args) as (gateway, harness):
        rows = await harness.dataset()

        async def first_turns_sampled() -> None:
            while len(policy.completions) < 4:
                await anyio.sleep(0.05)
            await anyio.sleep(0.2)  # the rollouts are now in the slow tool

        groups, stats, resources = await play(
            harness,
            harness.groups(rows[:2], size=2),
            SCRIPTED_POLICY,
            cancel_after=first_turns_sampled,
        )
        assert gateway.open_sessions == 0
    assert stats.settled[Status.CANCELLED] == 4
    assert all(t.status is Status.CANCELLED for g in groups for t in g.trajectories)
    assert resources.pools[0].released == 4 and resources.pools[0].quarantined == 0
    assert len(log.read_text().split()) == 4  # verifiers' cleanup ran for every rollout


async def test_bad_environments_fail_in_one_line(vf_python, qwen3_tokenizer, tmp_path):
    policy = ScriptedPolicy(qwen3_tokenizer, [ask_add])
    renderer = ChatRenderer(qwen3_tokenizer, template="model")
    none = tmp_path / "none.py"
    none.write_text("x = 1\n")
    async with Gateway(policy, renderer) as gateway, GatewayServer(gateway) as server:
        with pytest.raises(EnvError, match="defines no load_environment"):
            async with VerifiersHarness(server, none, python=vf_python):
                pass
        with pytest.raises(ConfigError, match="no interpreter"):
            async with VerifiersHarness(server, ADDER, python=tmp_path / "python"):
                pass


@pytest.mark.timeout(180)
def test_ctrl_c_during_verifiers_rollouts_leaks_nothing(vf_python, tmp_path):
    path = Path(__file__).with_name("verifiers_signal_script.py")
    env = {**os.environ, "PLIES_VERIFIERS_PYTHON": vf_python}
    script = EventScript([sys.executable, str(path), str(tmp_path)], env=env)
    try:
        # Every rollout is in the slow tool.
        in_tool = script.wait_for(lambda _: len(script.all("turn")) >= 4, 120)
        assert in_tool is not None, f"the script ended early: {script.events}\n{script.err}"
        time.sleep(0.5)
        for _ in range(2):  # drain, then cancel
            script.proc.send_signal(signal.SIGINT)
            time.sleep(0.5)
        code, err = script.finish(timeout=90)
    finally:
        script.finish(timeout=0.1)
    assert code == 130, err
    assert "Traceback" not in err and script.noise == [], err
    [ready] = script.all("ready")
    [stats] = script.all("stats")
    assert stats["live"] == 0 and stats["sessions"] == 0, stats
    assert stats["borrowed"] == stats["released"] + stats["quarantined"] == 4, stats
    read = read_jsonl(tmp_path / "groups.jsonl", Group)
    assert read.malformed == [] and len(read.records) == 2
    assert all(g.complete for g in read.records)
    assert {t.status for g in read.records for t in g.trajectories} <= {
        Status.CANCELLED,
        Status.QUARANTINED,
    }
    assert not Path(f"/proc/{ready['sidecar']}").exists(), "the sidecar is gone"
    # Every rollout was cancelled in the sidecar, confirmed, and cleaned up by verifiers.
    assert stats["quarantined"] == 0, stats
    assert {t.status for g in read.records for t in g.trajectories} == {Status.CANCELLED}
    assert len((tmp_path / "cleanups.log").read_text().split()) == 4


BOXED = Path(__file__).parent / "verifiers_envs" / "boxed.py"


@pytest.mark.parametrize(("answer", "reward"), [("\\boxed{42}", 1.0), ("\\boxed{41}", 0.0)])
async def test_verifiers_math_rubric_scores_a_single_turn_env(
    vf_python, qwen3_tokenizer, answer, reward
):
    policy = ScriptedPolicy(qwen3_tokenizer, [f"The product is {answer}."])
    async with served(policy, BOXED, vf_python, max_tokens=64) as (_, harness):
        assert harness.ready["environment"] == "SingleTurnEnv"
        rows = await harness.dataset()
        groups, _, resources = await play(harness, harness.groups(rows, size=2), SCRIPTED_POLICY)
        sidecar = harness._process.pid
        assert len(process_group(sidecar)) >= 2  # MathRubric's math-verify worker runs
    assert process_group(sidecar) == []  # the sidecar and its worker are gone
    [group] = groups
    for traj in group.trajectories:
        assert traj.status is Status.COMPLETED and traj.reward == reward
        assert traj.metrics["verifiers.correct_answer"] == reward
        assert len(traj.turns) == 1 and traj.turns[0].completion_ids == policy.completions[0].ids
    assert resources.released == 2 and resources.quarantined == 0


async def test_group_reward_functions_are_refused_in_one_line(vf_python, qwen3_tokenizer):
    policy = ScriptedPolicy(qwen3_tokenizer, ["\\boxed{42}"])
    renderer = ChatRenderer(qwen3_tokenizer, template="model")
    async with Gateway(policy, renderer) as gateway, GatewayServer(gateway) as server:
        harness = VerifiersHarness(server, BOXED, python=vf_python, env_args={"group_reward": True})
        with pytest.raises(ConfigError, match="group reward functions"):
            async with harness:
                pass
        process = harness._process
        assert process is not None and process.returncode is not None


async def test_a_history_the_env_rewrites_is_a_recorded_fallback_and_a_new_segment(
    vf_python, qwen3_tokenizer
):
    policy = ScriptedPolicy(qwen3_tokenizer, [ask_add, say_sum])
    args = {"rewrite_history": True}
    async with served(policy, ADDER, vf_python, env_args=args) as (gateway, harness):
        rows = await harness.dataset(n=1)
        [group], _, _ = await play(harness, harness.groups(rows, size=2), SCRIPTED_POLICY)
    for traj in group.trajectories:
        assert traj.status is Status.COMPLETED and traj.reward == 1.0
        assert [t.extends for t in traj.turns] == [False, False]
        assert [t.fallback for t in traj.turns] == [None, "history_edited"]
        assert traj.metrics["fallback.history_edited"] == 1
        # The second prompt is the full render of the rewritten history verifiers sent.
        system, _question, answer, result, _ = traj.info["verifiers"]["messages"]
        rewritten = [system, {"role": "user", "content": SUMMARY}, answer, result]
        tools = traj.info["verifiers"]["tools"]
        view = template_view(rewritten)
        assert traj.prompt_ids(1) == gateway.renderer.start(view, tools=tools).render()
        # Two segments, each sampled token trained once.
        assert [s.turns for s in traj.segments()] == [(0, 1), (1, 2)]
        assert sum(sum(s.mask) for s in traj.segments()) == sum(
            len(t.completion_ids) for t in traj.turns
        )
