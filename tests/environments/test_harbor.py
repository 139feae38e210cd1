"""Harbor tasks shipped in examples/harbor, played in bubblewrap sandboxes through the harness.

The rewards are what each task's own `tests/test.sh` wrote; the policy is scripted in Qwen3's
tool-call format through the real tokenizer, renderer and parser.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import tempfile
import time
from pathlib import Path

import anyio
import pytest
from scripted_policy import POLICY, ScriptedPolicy

from plies import ConfigError, EnvError, SandboxError, Status
from plies.environments import Forward, HarborEnv, HarborTask, Task
from plies.environments.reapers import reap_sandbox
from plies.harness import EpisodeLimits, ToolCallingHarness
from plies.policy import SamplingParams
from plies.runtime import EnvPool, GroupSpec, RolloutDriver, RolloutResources
from plies.testing import sandbox_processes
from plies.tokens import ChatRenderer

pytestmark = pytest.mark.anyio

TASKS = Path(__file__).parents[2] / "examples" / "harbor"
BASE = "FROM ubuntu:24.04\nWORKDIR /app\n"
FIX = "sed -i 's|/ (len(values) + 1)|/ len(values)|' /app/stats/core.py"


async def play(tokenizer, script, task: HarborTask, root: Path | None, n: int = 1, backend=None):
    """A group of `n` episodes of `task` through the harness; sandboxes under `root`, or from
    `backend` when given."""
    harness = ToolCallingHarness(
        ChatRenderer(tokenizer),
        ScriptedPolicy(tokenizer, script),
        SamplingParams(max_tokens=256, temperature=0.0),
        limits=EpisodeLimits(max_turns=8),
    )

    async def make() -> HarborEnv:
        return HarborEnv(task, backend or task.backend(root))

    async with RolloutResources(sampler=harness.sampler, pools=[EnvPool(make)]) as resources:
        async with RolloutDriver(resources, harness.play, policy=POLICY) as driver:
            await driver.admit(GroupSpec(task_id=task.name, size=n, task=Task(id=task.name)))
            driver.close_admission()
            with anyio.fail_after(120):
                [group] = [g async for g in driver.groups()]
        stats = resources.statistics()
    return group.trajectories, stats


def tool_messages(traj) -> list[str]:
    return [m["content"] for m in traj.messages if m["role"] == "tool"]


async def test_a_shipped_task_is_solved_with_reward_one_from_its_own_tests(
    qwen3_tokenizer, tmp_path
):
    async def script(session: str, turn: int, prompt: str):
        steps = [
            [("bash", {"command": "python3 -m unittest discover -s /app 2>&1 | tail -3"})],
            [("bash", {"command": "cat /app/stats/core.py"})],
            [("bash", {"command": FIX})],
        ]
        return steps[turn] if turn < len(steps) else [("submit", {})]

    task = HarborTask.load(TASKS / "fix-mean")
    trajs, stats = await play(qwen3_tokenizer, script, task, tmp_path, n=2)
    for traj in trajs:
        assert traj.status is Status.COMPLETED, (traj.error, traj.info)
        assert traj.reward == 1.0 and traj.info["env"]["rewards"] == {"reward": 1.0}
        failing, source, _ = tool_messages(traj)[:3]
        assert "FAILED (failures=1)" in failing
        assert "(len(values) + 1)" in source, "the agent saw the workspace the Dockerfile built"
    assert stats.borrowed == stats.released == 2 and stats.quarantined == 0
    assert list(tmp_path.iterdir()) == [], "every sandbox directory was removed"
    assert sandbox_processes(tmp_path) == []


async def test_with_no_solution_the_reward_is_zero_and_nothing_is_left(qwen3_tokenizer, tmp_path):
    async def script(session: str, turn: int, prompt: str):
        if turn == 0:  # leave a process behind, and try to write the reward itself
            return [("bash", {"command": "sleep 300 & echo 1 > /logs/verifier/reward.txt"})]
        return [("submit", {})]

    for name in ("fix-mean", "count-lines"):
        task = HarborTask.load(TASKS / name)
        [traj], stats = await play(qwen3_tokenizer, script, task, tmp_path)
        assert traj.status is Status.COMPLETED and traj.reward == 0.0, traj.info
        assert stats.released == 1 and stats.quarantined == 0
    assert list(tmp_path.iterdir()) == []
    assert sandbox_processes(tmp_path) == []


@pytest.mark.parametrize("name", ["fix-mean", "count-lines"])
async def test_the_oracle_solves_each_shipped_task(name, tmp_path):
    task = HarborTask.load(TASKS / name)
    async with HarborEnv(task, task.backend(tmp_path)) as env:
        await env.reset(Task(id=name))
        result = await env.oracle()
    assert result.done and result.reward == 1.0, result.info
    assert result.info["solve_exit_code"] == 0
    assert list(tmp_path.iterdir()) == []


async def test_the_sandbox_gives_the_task_its_paths_and_nothing_of_the_host(tmp_path):
    task = HarborTask.load(TASKS / "count-lines")
    probe = (
        "echo wd=$PWD; ls /tests | wc -l; test -w /logs && echo logs-writable; "
        "touch /tests/x 2>/dev/null || echo tests-read-only; "
        f"ls {Path.cwd()} >/dev/null 2>&1 || echo host-hidden; ls /root | wc -l; "
        "python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 53), 2)' "
        "2>/dev/null || echo no-network; echo log=$LOG_NAME"
    )
    async with HarborEnv(task, task.backend(tmp_path)) as env:
        await env.reset(Task(id="probe"))
        result = await env.call_tool("bash", {"command": probe})
    lines = result.content.splitlines()
    assert lines[0] == "exit code 0"
    assert lines[1:] == [
        "wd=/app", "0", "logs-writable", "tests-read-only", "host-hidden", "0", "no-network",
        "log=log.txt",
    ]  # fmt: skip


async def test_a_forward_is_the_one_way_out_and_shares_are_read_only(tmp_path):
    """A forwarded loopback port reaches the host's Unix socket; another port open on the
    host does not; a shared host directory is visible and read-only; exit codes pass through."""
    task = HarborTask.load(TASKS / "count-lines")
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "tool.txt").write_text("from the host\n")
    with (
        tempfile.TemporaryDirectory(prefix="plies-fw-") as short,
        socket.create_server(("127.0.0.1", 0)) as other,
    ):
        path = Path(short) / "echo.sock"

        async def echo(stream) -> None:
            async with stream:
                await stream.send(b"echo:" + await stream.receive())

        listener = await anyio.create_unix_listener(path)
        probe = (
            "import socket, sys\n"
            "s = socket.create_connection(('127.0.0.1', 4321), 5); s.sendall(b'hi')\n"
            "print(s.recv(100).decode())\n"
            f"print('other', socket.socket().connect_ex(('127.0.0.1', {other.getsockname()[1]})))\n"
            "sys.exit(3)\n"
        )
        backend = task.backend(
            tmp_path / "boxes", shares=[shared], forwards=[Forward(4321, str(path))]
        )
        async with anyio.create_task_group() as tg, listener:
            tg.start_soon(listener.serve, echo)
            async with HarborEnv(task, backend) as env:
                await env.reset(Task(id="forward"))
                sandbox = env.workspace
                result = await sandbox.run(["python3", "-c", probe], timeout_s=30)
                shown = await sandbox.run(
                    ["sh", "-c", f"cat {shared}/tool.txt; touch {shared}/x || echo read-only"],
                    timeout_s=30,
                )
            tg.cancel_scope.cancel()
    assert result.exit_code == 3, result
    lines = result.stdout.splitlines()
    assert lines[0] == "echo:hi" and lines[1] != "other 0", lines
    assert shown.stdout.splitlines() == ["from the host", "read-only"]
    assert not (shared / "x").exists()


@pytest.mark.parametrize(
    ("forward", "why"),
    [
        (Forward(0, "/tmp/x.sock"), "port must be 1-65535"),
        (Forward(80, "relative.sock"), "must be an absolute path"),
    ],
)
def test_a_bad_forward_or_share_is_refused_in_one_line(forward, why):
    task = HarborTask.load(TASKS / "count-lines")
    with pytest.raises(ConfigError, match=why):
        task.backend(forwards=[forward])
    with pytest.raises(ConfigError, match="must be absolute and exist"):
        task.backend(shares=["relative/dir"])


async def test_the_agent_timeout_ends_the_episode_with_the_tests_verdict(tmp_path):
    task = HarborTask.load(TASKS / "count-lines")
    task = dataclasses.replace(task, agent_timeout_s=1.0)
    async with HarborEnv(task, task.backend(tmp_path)) as env:
        await env.reset(Task(id="slow"))
        started = time.monotonic()
        cut = await env.call_tool("bash", {"command": "sleep 30"})
        assert time.monotonic() - started < 10
        assert "timed out" in cut.content and not cut.done
        late = await env.call_tool("bash", {"command": "echo 13 > /app/answer.txt"})
    assert late.done and late.info["agent_timeout"] and late.reward == 0.0
    assert sandbox_processes(tmp_path) == []


def write_task(root: Path, dockerfile: str, toml: str = "") -> Path:
    for name in ("environment", "tests"):
        (root / name).mkdir(parents=True)
    (root / "task.toml").write_text(toml)
    (root / "instruction.md").write_text("Do it.")
    (root / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    (root / "environment" / "Dockerfile").write_text(dockerfile)
    (root / "environment" / "a.txt").write_text("a")
    return root


@pytest.mark.parametrize(
    ("dockerfile", "line", "why"),
    [
        (f"{BASE}ADD https://x.org/a.tgz /app/\n", 3, "URL"),
        (f"{BASE}RUN apt-get update && \\\n  apt-get install -y git\n", 3, "network (apt-get)"),
        ("FROM a AS build\nFROM b\nWORKDIR /app\n", 2, "multi-stage"),
        (f"{BASE}VOLUME /data\n", 3, "VOLUME cannot be honoured"),
        (f"{BASE}USER nobody\n", 3, "only root"),
        (f"{BASE}COPY --from=build /x /app/\n", 3, "--from"),
        (f"{BASE}COPY ../secret /app/\n", 3, "not in the build context"),
        (f"{BASE}RUN pip install numpy\n", 3, "pip install"),
    ],
)
def test_an_unsupported_dockerfile_is_refused_in_one_line(tmp_path, dockerfile, line, why):
    root = write_task(tmp_path / "task", dockerfile)
    with pytest.raises(ConfigError) as caught:
        HarborTask.load(root)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{root}/environment/Dockerfile:{line}: ")
    assert why in message


@pytest.mark.parametrize(
    ("toml", "why"),
    [
        ('[environment]\ndocker_image = "alpine:3"\n', "a prebuilt docker_image"),
        ("[environment]\ngpus = 1\n", "GPUs"),
        ("[agent]\ntimeout_sec = -1\n", "agent.timeout_sec"),
        ("[verifier\n", "not TOML"),
    ],
)
def test_an_unsupported_task_toml_is_refused_in_one_line(tmp_path, toml, why):
    root = write_task(tmp_path / "task", "FROM a\nWORKDIR /app\n", toml)
    with pytest.raises(ConfigError, match=re.escape(why)) as caught:
        HarborTask.load(root)
    assert str(caught.value).startswith(f"{root}/task.toml: ")


async def test_a_recorded_sandbox_is_reaped_by_kind_and_id(tmp_path):
    task = HarborTask.load(TASKS / "count-lines")
    env = HarborEnv(task, task.backend(tmp_path))
    await env.reset(Task(id="lost"))
    [ref] = env.remote_refs()
    assert ref.kind == "bwrap-sandbox"
    async with anyio.create_task_group() as tg:  # a command still running when the run died
        tg.start_soon(env.call_tool, "bash", {"command": "sleep 300"})
        with anyio.fail_after(10):
            while not sandbox_processes(tmp_path):
                await anyio.sleep(0.05)
        assert await reap_sandbox(ref.kind, ref.id)
    assert sandbox_processes(tmp_path) == [] and not Path(ref.id).exists()
    await env.close()  # finds the sandbox gone
    assert os.path.isdir(tmp_path) and list(tmp_path.iterdir()) == []


async def test_a_bubblewrap_failure_is_a_sandbox_error_not_the_commands_output(tmp_path):
    task = HarborTask.load(TASKS / "count-lines")
    env = HarborEnv(task, task.backend(tmp_path))
    await env.reset(Task(id="broken"))
    env.backend.workdir = "/proc/1/bad"  # bwrap cannot mount the workspace there
    with pytest.raises(SandboxError, match=r"^bubblewrap could not start the sandbox: bwrap: "):
        await env.call_tool("bash", {"command": "echo hi"})
    await env.close()
    assert list(tmp_path.iterdir()) == []


async def test_runs_see_the_env_set_before_them_and_a_failing_run_names_its_line(tmp_path):
    dockerfile = (
        f'{BASE}RUN echo "[$LATE]" > early.txt\nENV LATE=yes\nRUN echo "[$LATE]" > late.txt\n'
    )
    task = HarborTask.load(write_task(tmp_path / "ok", dockerfile))
    async with HarborEnv(task, task.backend(tmp_path / "sandboxes")) as env:
        await env.reset(Task(id="ok"))
        shown = await env.call_tool("bash", {"command": "cat early.txt late.txt; echo $LATE"})
    assert shown.content == "exit code 0\n[]\n[yes]\nyes\n"

    broken = HarborTask.load(write_task(tmp_path / "broken", f"{BASE}RUN echo no >&2; false\n"))
    env = HarborEnv(broken, broken.backend(tmp_path / "sandboxes"))
    with pytest.raises(EnvError) as caught:
        await env.reset(Task(id="broken"))
    await env.close()
    assert str(caught.value) == (
        f"{tmp_path}/broken/environment/Dockerfile:3: RUN failed in the sandbox with exit "
        "code 1: no"
    )
    assert list((tmp_path / "sandboxes").iterdir()) == []


async def test_the_tiny_random_model_earns_nothing_and_leaves_nothing(
    policy_server, tiny_model_dir, tmp_path
):
    """Real sampling from `plies serve`: garbage never solves the task; the sandbox goes."""
    from transformers import AutoTokenizer

    from plies.policy import VLLMClient

    task = HarborTask.load(TASKS / "fix-mean")
    async with VLLMClient(policy_server.url, policy_server.model) as client:
        harness = ToolCallingHarness(
            ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_dir)),
            client,
            SamplingParams(max_tokens=24, temperature=1.0),
            limits=EpisodeLimits(max_turns=3),
            correction="Call a tool.",
        )
        async with HarborEnv(task, task.backend(tmp_path)) as env:
            traj = await harness.run(env, Task(id="tiny"))
    assert traj.status in (Status.TRUNCATED, Status.COMPLETED), traj.error
    assert traj.reward == 0.0 and len(traj.turns) >= 1
    assert list(tmp_path.iterdir()) == [] and sandbox_processes(tmp_path) == []
