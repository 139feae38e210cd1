"""Third-party MCP servers' tools drive plies episodes through `ToolCallingHarness`.

The servers are the real ones from PyPI (`mcp-server-time`, `mcp-server-sqlite`) and npm
(`@modelcontextprotocol/server-memory`, `server-everything`); the policy is scripted in Qwen3's
tool-call format and goes through the real tokenizer, renderer and parser.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import anyio
import httpx
import pytest
from scripted_policy import POLICY, ScriptedPolicy

from plies import ConfigError, EnvError, Status
from plies.environments import McpEnv, McpHost, McpServer, Task
from plies.environments.mcp_client import marked_processes
from plies.harness import EpisodeLimits, ToolCallingHarness
from plies.policy import SamplingParams
from plies.runtime import EnvPool, GroupSpec, RolloutDriver, RolloutResources
from plies.tokens import ChatRenderer

# Leak checks count every MCP server process on the machine: the tests that start them run
# on one worker (`--dist loadgroup`), so no check sees another test's live servers.
MCP_PROCESSES = pytest.mark.xdist_group("mcp_processes")
pytestmark = [pytest.mark.anyio, MCP_PROCESSES]

BIN = Path(os.environ.get("PLIES_MCP_SERVER_BIN") or Path(sys.executable).parent)
"""Where the PyPI servers are: this environment's, or (.ci/mcp2-tier, whose SDK is 2.x) the
main one's, so a 2.x client talks to servers built on the 1.x SDK they were released with."""
TOKYO = {"source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo"}


def harness(tokenizer, script) -> ToolCallingHarness:
    return ToolCallingHarness(
        ChatRenderer(tokenizer),
        ScriptedPolicy(tokenizer, script),
        SamplingParams(max_tokens=256, temperature=0.0),
        limits=EpisodeLimits(max_turns=6),
    )


async def drive(host: McpHost, h: ToolCallingHarness, tasks: list[Task], score=None):
    """Play each task as its own group through the driver; returns trajectories and stats."""

    async def make() -> McpEnv:
        return host.env(score=score)

    async with RolloutResources(sampler=h.sampler, pools=[EnvPool(make, limit=8)]) as resources:
        async with RolloutDriver(
            resources, h.play, policy=POLICY, max_groups_in_flight=None
        ) as driver:
            for task in tasks:
                await driver.admit(GroupSpec(task_id=task.id, task=task))
            driver.close_admission()
            with anyio.fail_after(120):
                groups = [g async for g in driver.groups()]
        stats = resources.statistics()
    trajs = {g.trajectories[0].task_id: g.trajectories[0] for g in groups}
    return trajs, stats


def tool_messages(traj) -> list[str]:
    return [m["content"] for m in traj.messages if m["role"] == "tool"]


async def test_a_stateless_pypi_server_is_shared_and_its_errors_reach_the_model(qwen3_tokenizer):
    async def script(session: str, turn: int, prompt: str):
        if turn == 0:  # a timezone the server refuses, then arguments the schema refuses
            return [("convert_time", {**TOKYO, "target_timezone": "Nowhere/Atlantis"}),
                    ("convert_time", {"time": "12:00"})]  # fmt: skip
        if turn == 1:
            return [("convert_time", TOKYO)]
        found = re.findall(r'"datetime": "2026-\d\d-\d\dT(\d\d:\d\d):00\+09:00"', prompt)
        return [("submit", {"answer": found[-1] if found else "?"})]

    async def score(env: McpEnv, answer: str) -> float:
        return 1.0 if answer == "21:00" else 0.0

    server = McpServer.stdio([str(BIN / "mcp-server-time")], stateless=True)
    async with McpHost(server) as host:
        tasks = [Task(id=f"tokyo-{i}", data={"prompt": "What time is noon UTC in Tokyo?"})
                 for i in range(3)]  # fmt: skip
        trajs, stats = await drive(host, harness(qwen3_tokenizer, script), tasks, score)
        assert host.statistics().sessions_opened == 1, "a stateless server is started once"
    assert marked_processes() == []
    assert stats.borrowed == stats.released == 3 and stats.quarantined == 0
    for traj in trajs.values():
        assert traj.status is Status.COMPLETED and traj.reward == 1.0, traj.info
        refused, invalid, answer, _ = tool_messages(traj)
        assert "Invalid timezone" in refused and "Nowhere/Atlantis" in refused
        assert "'source_timezone' is a required property" in invalid
        assert '"time_difference": "+9.0h"' in answer
        assert traj.metrics["tool_errors"] == 2.0
        names = {t["function"]["name"] for t in traj.info["tools"]}
        assert names == {"get_current_time", "convert_time", "submit"}


async def test_two_concurrent_episodes_on_a_stateful_server_never_share_state(
    qwen3_tokenizer, npm_bin
):
    """server-memory keeps its graph in one file per process: each episode gets its own."""
    both_wrote = anyio.Event()
    wrote: set[str] = set()
    seen: dict[str, str] = {}

    async def script(session: str, turn: int, prompt: str):
        me = re.search(r"You are agent (\w+)\.", prompt)[1]
        if turn == 0:
            entity = {"name": f"secret-of-{me}", "entityType": "note", "observations": [me]}
            return [("create_entities", {"entities": [entity]})]
        if turn == 1:
            wrote.add(me)
            if len(wrote) == 2:
                both_wrote.set()
            with anyio.fail_after(30):
                await both_wrote.wait()  # both servers hold a write before either reads
            return [("read_graph", {})]
        names = sorted(set(re.findall(r"secret-of-(\w+)", prompt.split("<tool_response>")[-1])))
        seen[me] = ",".join(names)
        return [("submit", {"answer": seen[me]})]

    async def score(env: McpEnv, answer: str) -> float:
        graph = await env.session.client.call_tool("read_graph", {})
        entities = json.loads(graph.content[0].text)["entities"]
        mine = [e["name"] for e in entities]
        return 1.0 if mine == [f"secret-of-{answer}"] else 0.0

    server = McpServer.stdio(
        [str(npm_bin / "mcp-server-memory")],
        env={"MEMORY_FILE_PATH": "{episode_dir}/memory.jsonl"},
    )
    async with McpHost(server) as host:
        tasks = [Task(id=n, data={"prompt": f"You are agent {n}. Remember a secret."})
                 for n in ("alice", "bob")]  # fmt: skip
        trajs, stats = await drive(host, harness(qwen3_tokenizer, script), tasks, score)
        assert host.statistics().sessions_opened == 2
        assert host.statistics().sessions_open == 0
    assert seen == {"alice": "alice", "bob": "bob"}
    for name, traj in trajs.items():
        assert traj.status is Status.COMPLETED and traj.reward == 1.0, traj.info
        graph = json.loads(tool_messages(traj)[1])
        assert [e["name"] for e in graph["entities"]] == [f"secret-of-{name}"]
    assert stats.borrowed == stats.released == 2 and stats.quarantined == 0
    assert marked_processes() == [], "every server process is gone"
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob("plies-mcp-*/memory.jsonl"))


async def test_a_per_episode_database_from_pypi_sqlite(qwen3_tokenizer):
    """mcp-server-sqlite on a database file in the episode's own directory."""

    async def script(session: str, turn: int, prompt: str):
        steps = [
            [("create_table", {"query": "CREATE TABLE t (x INTEGER)"})],
            [("write_query", {"query": "INSERT INTO t VALUES (20), (22)"})],
            [("read_query", {"query": "SELECT SUM(x) AS s FROM t"})],
        ]
        if turn < len(steps):
            return steps[turn]
        return [("submit", {"answer": re.findall(r"'s': (\d+)", prompt)[-1]})]

    async def score(env: McpEnv, answer: str) -> float:
        return 1.0 if answer == "42" else 0.0

    server = McpServer.stdio([str(BIN / "mcp-server-sqlite"), "--db-path", "{episode_dir}/x.db"])
    async with McpHost(server) as host:
        tasks = [Task(id=f"sum-{i}", data={"prompt": "Add 20 and 22 in SQL."}) for i in range(2)]
        trajs, _ = await drive(host, harness(qwen3_tokenizer, script), tasks, score)
    # Each episode created table t in its own database: a shared one would refuse the second.
    for traj in trajs.values():
        assert traj.status is Status.COMPLETED and traj.reward == 1.0, tool_messages(traj)
    assert marked_processes() == []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_streamable_http_server_gives_each_episode_its_own_session(
    qwen3_tokenizer, npm_bin, tmp_path
):
    port = free_port()
    log = (tmp_path / "everything.log").open("w")
    process = subprocess.Popen(
        [str(npm_bin / "mcp-server-everything"), "streamableHttp"],
        env={**os.environ, "PORT": str(port)}, stdout=log, stderr=log, start_new_session=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}/mcp"
        with anyio.fail_after(30):
            while True:
                try:
                    async with httpx.AsyncClient() as http:
                        await http.get(url)
                    break
                except httpx.TransportError:
                    await anyio.sleep(0.1)

        async def script(session: str, turn: int, prompt: str):
            if turn == 0:
                return [("echo", {"message": f"hello from {session}"})]
            return [("submit", {"answer": re.findall(r"Echo: (hello from \S+)", prompt)[-1]})]

        async def score(env: McpEnv, answer: str) -> float:
            return 1.0 if answer.startswith("hello from ") else 0.0

        async with McpHost(McpServer.http(url)) as host:
            tasks = [Task(id=f"echo-{i}", data={"prompt": "Say hello."}) for i in range(2)]
            trajs, stats = await drive(host, harness(qwen3_tokenizer, script), tasks, score)
        for traj in trajs.values():
            assert traj.status is Status.COMPLETED and traj.reward == 1.0, tool_messages(traj)
            assert tool_messages(traj)[0] == f"Echo: hello from {traj.id}"
        assert stats.released == 2 and stats.quarantined == 0
    finally:
        process.kill()
        process.wait()
        log.close()


async def test_a_server_that_cannot_start_is_one_clear_error_and_leaves_nothing():
    server = McpServer.stdio([str(BIN / "python"), "-c", "import sys; sys.exit('no tools today')"])
    async with McpHost(server, init_timeout_s=20) as host:
        env = host.env()
        with pytest.raises(EnvError) as caught:
            await env.reset(Task(id="t", data={"prompt": "hi"}))
        await env.close()
    text = str(caught.value)
    assert "could not start an MCP session with python" in text
    assert "no tools today" in text, "the server's stderr says why"
    assert marked_processes() == []


async def test_a_server_killed_mid_episode_is_an_env_error(npm_bin):
    server = McpServer.stdio(
        [str(npm_bin / "mcp-server-memory")],
        env={"MEMORY_FILE_PATH": "{episode_dir}/memory.jsonl"},
    )
    async with McpHost(server, call_timeout_s=10) as host, host.env() as env:
        await env.reset(Task(id="t", data={"prompt": "hi"}))
        [ref] = env.remote_refs()
        assert ref.kind == "process"
        os.killpg(int(ref.id.split("@")[0]), 9)
        with pytest.raises(EnvError):
            await env.call_tool("read_graph", {})
    assert marked_processes() == []


async def test_a_task_without_a_prompt_is_refused_by_name():
    server = McpServer.stdio([str(BIN / "mcp-server-time")], stateless=True)
    async with McpHost(server) as host, host.env() as env:
        with pytest.raises(ConfigError, match="task 'p' needs data\\['prompt'\\]"):
            await env.reset(Task(id="p"))
    assert marked_processes() == []


async def test_what_a_server_leaves_behind_is_killed_when_its_episode_ends():
    """A server whose child outlives it (as npx's do) leaves nothing after the session."""
    command = f"sleep 300 & exec {BIN / 'mcp-server-time'}"
    async with McpHost(McpServer.stdio(["sh", "-c", command])) as host:
        async with host.env() as env:
            await env.reset(Task(id="t", data={"prompt": "hi"}))
            assert len(marked_processes()) == 2
        assert host.statistics().stragglers_killed == 1
        assert marked_processes() == []


async def test_file_and_git_servers_work_in_the_episodes_own_directory(qwen3_tokenizer, npm_bin):
    """npm's server-filesystem and PyPI's mcp-server-git, each confined to its episode."""
    files = McpServer.stdio([str(npm_bin / "mcp-server-filesystem"), "{episode_dir}"])

    async def write_then_read(session: str, turn: int, prompt: str):
        me = re.search(r"Write a note for (\w+)\.", prompt)[1]
        if turn == 0:
            return [("list_allowed_directories", {})]
        note = re.findall(r"(/\S*plies-mcp-\w+)", prompt)[-1] + "/note.txt"
        if turn == 1:
            return [("write_file", {"path": note, "content": me})]
        if turn == 2:
            return [
                ("read_text_file", {"path": note}),
                ("read_text_file", {"path": "/etc/hostname"}),
            ]
        return [("submit", {"answer": "done"})]

    async def file_holds_the_episode(env: McpEnv, answer: str) -> float:
        text = (env.session.directory / "note.txt").read_text()
        return 1.0 if text == env.task.id else 0.0

    async with McpHost(files) as host:
        tasks = [Task(id=f"f{i}", data={"prompt": f"Write a note for f{i}."}) for i in range(2)]
        trajs, _ = await drive(
            host, harness(qwen3_tokenizer, write_then_read), tasks, file_holds_the_episode
        )
    for task_id, traj in trajs.items():
        assert traj.status is Status.COMPLETED and traj.reward == 1.0, (traj.error, traj.info)
        listed, wrote, read, outside = tool_messages(traj)[:4]
        assert "plies-mcp-" in listed and "Successfully wrote" in wrote
        assert read == task_id, "each episode reads what it wrote, in its own directory"
        assert "denied" in outside.lower(), outside
    assert marked_processes() == []

    async def status_of_nowhere(session: str, turn: int, prompt: str):
        if turn == 0:
            return [("git_status", {"repo_path": "/nowhere"})]
        return [("submit", {"answer": "ok"})]

    git = McpServer.stdio([str(BIN / "mcp-server-git")])
    async with McpHost(git) as host:
        task = Task(id="g", data={"prompt": "Git."})
        trajs, _ = await drive(host, harness(qwen3_tokenizer, status_of_nowhere), [task])
    [traj] = trajs.values()
    names = {t["function"]["name"] for t in traj.info["tools"]}
    assert {"git_status", "git_diff", "git_commit", "submit"} <= names
    assert traj.metrics["tool_errors"] == 1.0 and traj.status is Status.COMPLETED
    assert marked_processes() == []
