"""`ShardedDriver` over a real two-node Ray cluster on this machine.

Two `ray start` processes make the cluster: a head, then a worker node that joins it with
`--address`. Each runs in a session of its own, with one CPU, a custom resource of its own
(`node_a`, `node_b`) and ports of its own (free ones, so no other Ray on the machine is in the
way); the cluster has its own `--temp-dir`. Shard 0 is pinned to the head node and shard 1 to
the worker node (`shard_options`), and each episode names the node and process that played
it (`placed_episode`). Checked, for real:

- every group lands on disk exactly once, played on both nodes, each shard on its own node;
- SIGKILL of the worker node's shard settles its groups as lost (failed, `ShardLost`), at
  once, while the head node's shard goes on;
- Ctrl-C of a driver script on the cluster drains it: exit code 130, every group it admitted
  on disk once, and nothing of the run left: not the script's processes, nor a shard actor
  on either node;
- at the end (whatever the tests did) both nodes are stopped by session, and no process of
  the cluster is left.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
from sessions import Script, end_sessions, left_after
from shard_parts import SKIP, make_shard, placed_episode, task

pytest.importorskip("ray.actor", reason=SKIP)

from plies import ConfigError, Group, PolicyRef, Status
from plies.runtime import GroupSpec, JsonlSink, ShardedDriver, read_jsonl

pytestmark = pytest.mark.timeout(120)

HERE = Path(__file__).parent
RAY = Path(sys.executable).with_name("ray")
PINS = ("node_a", "node_b")
"""The custom resource of the head node, and of the worker node."""
V0 = PolicyRef(uri="plies://two-nodes/policies/0", version=0)


@dataclass(frozen=True)
class Cluster:
    address: str
    nodes: tuple[str, ...]
    """Ray node ids: the head node's, the worker node's."""
    sessions: tuple[int, ...]
    """The session of each `ray start`: every process of that node is in it."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def ray_start(log: Path, sessions: list[int], *args: str) -> None:
    """`ray start ARGS` in a session of its own (noted in `sessions` before it can leave
    anything behind), with one CPU and free ports for everything a node listens on."""
    listens = ("node-manager", "object-manager", "metrics-export", "runtime-env-agent")
    agent = ("dashboard-agent-grpc", "dashboard-agent-listen")
    ports = [f"--{name}-port={free_port()}" for name in listens + agent]
    command = [str(RAY), "start", "--num-cpus=1", "--disable-usage-stats", *ports, *args]
    # Workers bind random ports, not the 10002-19999 range every other Ray here uses.
    command += ["--min-worker-port=0", "--max-worker-port=0"]
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        sessions.append(proc.pid)
        code = proc.wait(timeout=120)
    assert code == 0, log.read_text()[-4000:]


def pin(name: str) -> str:
    return "--resources=" + json.dumps({name: 1})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The two nodes, and this process joined to them as a driver; both nodes stopped after."""
    import ray

    temp = tmp_path_factory.mktemp("ray")  # a short path: Ray's sockets go under it
    sessions: list[int] = []
    try:
        port = free_port()
        head = ["--head", f"--port={port}", f"--temp-dir={temp}", "--include-dashboard=false"]
        ray_start(
            temp / "head.log", sessions, *head, f"--dashboard-port={free_port()}", pin(PINS[0])
        )
        address = f"127.0.0.1:{port}"
        # One log monitor per host: the head's.
        worker = [f"--address={address}", "--include-log-monitor=false", pin(PINS[1])]
        ray_start(temp / "worker.log", sessions, *worker)
        ray.init(address=address, runtime_env={"env_vars": {"PYTHONPATH": str(HERE)}})
        try:
            alive = [n for n in ray.nodes() if n["Alive"]]
            nodes = tuple(n["NodeID"] for name in PINS for n in alive if name in n["Resources"])
            assert len(alive) == 2 and len(set(nodes)) == 2, alive
            yield Cluster(address, nodes, tuple(sessions))
        finally:
            ray.shutdown()
    finally:
        assert end_sessions(sessions) == []


def pinned_driver(policy_url: str, **kwargs: Any) -> ShardedDriver:
    """Two shards on the cluster: shard 0 on the head node, shard 1 on the worker node."""
    return ShardedDriver(
        partial(make_shard, policy_url, play=placed_episode),
        shards=2,
        policy=V0,
        shard_options=[{"resources": {name: 1}} for name in PINS],
        **kwargs,
    )


def test_shard_options_are_one_per_shard():
    with pytest.raises(ConfigError, match="1 entries for 2 shards"):
        ShardedDriver(partial(make_shard, "http://unused"), shards=2, policy=V0, shard_options=[{}])


def once_on_disk(path: Path) -> list[Group]:
    """The sink's groups, each whole and there exactly once."""
    read = read_jsonl(path, Group)
    ids = [g.id for g in read.records]
    assert read.malformed == [] and len(ids) == len(set(ids)), ids
    return read.records


def where_played(groups: list[Group]) -> set[tuple[int, str]]:
    """(process, node) of every member that a shard played."""
    return {(t.info["pid"], t.info["node"]) for g in groups for t in g.trajectories if t.info}


@pytest.mark.anyio
async def test_every_group_lands_on_disk_once_from_both_nodes(cluster, policy_url, tmp_path):
    specs = [GroupSpec(f"task{i}", size=2, task=task(1 + i % 2), id=f"g{i}") for i in range(10)]
    with JsonlSink(tmp_path / "groups.jsonl") as sink:
        async with pinned_driver(policy_url, sink=sink, max_groups_in_flight=4) as d:
            async with anyio.create_task_group() as tg:
                tg.start_soon(admit_then_close, d, specs)
                handed = [g.id async for g in d.groups()]
            stats, shards = d.statistics(), d.shard_statistics()
            sessions = [os.getsid(s.pid) for s in shards]  # while the shards are there
    on_disk = once_on_disk(tmp_path / "groups.jsonl")
    assert sorted(g.id for g in on_disk) == sorted(handed) == sorted(s.id for s in specs)
    assert {t.status for g in on_disk for t in g.trajectories} == {Status.COMPLETED}
    assert stats.settled[Status.COMPLETED] == stats.admitted == 2 * len(specs)
    # Each shard played on the node it was pinned to, in a process of that node's session.
    placed = zip(shards, cluster.nodes, strict=True)
    assert where_played(on_disk) == {(s.pid, node) for s, node in placed}
    assert sessions == list(cluster.sessions)


async def admit_then_close(driver: ShardedDriver, specs: list[GroupSpec]) -> None:
    for spec in specs:
        await driver.admit(spec)
    driver.close_admission()


@pytest.mark.anyio
async def test_sigkill_of_the_worker_nodes_shard_settles_its_groups_as_lost(
    cluster, policy_url, tmp_path, caplog
):
    caplog.set_level(logging.ERROR, logger="plies.runtime")
    specs = [GroupSpec(f"slow{i}", size=2, task=task(2, sample_s=1.5)) for i in range(4)]
    with JsonlSink(tmp_path / "groups.jsonl") as sink:
        async with pinned_driver(policy_url, sink=sink, max_groups_in_flight=8) as d:
            for spec in specs:
                await d.admit(spec)
            with anyio.fail_after(30):  # both shards run their two groups
                while min(s.running for s in d.shard_statistics()) < 4:
                    await anyio.sleep(0.05)
            head_shard, remote = d.shard_statistics()
            assert os.getsid(remote.pid) == cluster.sessions[1]  # the worker node's process
            os.kill(remote.pid, signal.SIGKILL)
            d.close_admission()
            groups = [g async for g in d.groups()]
            stats, shards = d.statistics(), d.shard_statistics()
    assert not shards[1].alive and shards[1].groups_lost == 2 and shards[1].groups_in_flight == 0
    assert shards[0].alive and shards[0].groups_lost == 0
    # The lost groups are handed out first: settled on the shard's death, not at exit, long
    # before the head node's episodes (two turns of a 1.5 s sample) could end.
    lost, rest = groups[:2], groups[2:]
    for group in lost:
        assert [t.status for t in group.trajectories] == [Status.FAILED] * 2
        assert all("ShardLost" in t.error and "shard 1 died" in t.error for t in group.trajectories)
    assert {t.status for g in rest for t in g.trajectories} == {Status.COMPLETED}
    assert where_played(rest) == {(head_shard.pid, cluster.nodes[0])}
    on_disk = once_on_disk(tmp_path / "groups.jsonl")
    assert sorted(g.task_id for g in on_disk) == sorted(s.task_id for s in specs)
    assert stats.settled[Status.FAILED] == 4 and stats.settled[Status.COMPLETED] == 4
    assert stats.running == 0
    assert any("shard 1 lost" in r.getMessage() for r in caplog.records)


def test_ctrl_c_on_a_script_over_both_nodes_leaves_no_ray_process_of_it(
    cluster, policy_url, tmp_path
):
    script = Script(tmp_path, policy_url, 1, cluster.address, *PINS)
    sid = script.proc.pid
    try:
        assert script.ready.wait(60), "the script never became ready:\n" + "".join(script.stderr)
        deadline = time.monotonic() + 30
        while len(script.ids("group")) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(sid, signal.SIGINT)
        code, err = script.finish(timeout=60)
    finally:
        if script.proc.poll() is None:
            os.killpg(sid, signal.SIGKILL)
    assert code == 130 and "Traceback" not in err, err[-4000:]
    on_disk = once_on_disk(tmp_path / "groups.jsonl")
    assert script.ids("admitted") <= {g.id for g in on_disk}, err[-4000:]
    assert {t.status for g in on_disk for t in g.trajectories} == {Status.COMPLETED}
    assert {node for _, node in where_played(on_disk)} == set(cluster.nodes)
    # Nothing of the run is left: no process of the script, no shard actor on either node.
    # (The nodes are the cluster's, left running; the fixture stops them and checks.)
    assert left_after(sid, 15) == []
    for node in cluster.sessions:
        assert left_after(node, 15, "ray::ShardActor") == []
