"""A rollout script for the signal tests: a driver against real servers, under `run`.

    python signal_script.py RUN_DIR POLICY_URL SEED [MAX_TASKS]

Episodes borrow an op-server process each (a real child process, in its own process group),
sample from POLICY_URL (a stand-in policy server) and run remote steps of random length on
their process. Events go to stdout as JSON lines: spawn / torn_down (pid), ready, group
(after the sink wrote it), and stats at the very end.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))  # event_script
sys.path.insert(0, str(Path(__file__).parents[1] / "ray"))  # shard_parts: the op server's turns

import httpx
from event_script import drive, emit
from runtime_helpers import OpProcess, spawn_op_server
from shard_parts import stand_in_turn

from plies import AdmissionClosed, Group, PolicyRef
from plies.runtime import (
    EnvPool,
    GroupSpec,
    RolloutDriver,
    RolloutResources,
    read_jsonl,
    run,
)

REF = PolicyRef(uri="plies://signals/policies/0", version=0)


async def main(interrupts, run_dir: Path, policy_url: str, seed: int, max_tasks: int) -> None:
    rng = random.Random(seed)
    sink_path = run_dir / "groups.jsonl"
    done = {g.task_id for g in read_jsonl(sink_path, Group).records}

    async def create() -> OpProcess:
        return await spawn_op_server(on_spawn=lambda pid: emit("spawn", pid=pid))

    async def teardown(proc: OpProcess) -> None:
        await proc.aclose()
        emit("torn_down", pid=proc.pid)

    pool = EnvPool(
        create,
        teardown=teardown,
        kind="process",
        limit=8,
        settle_timeout=0.5,
        teardown_timeout=3,
        teardown_retries=2,
        retry_backoff=0.1,
    )
    resources = RolloutResources(
        sampler=policy_url, pools=[pool], report_path=run_dir / "quarantine.json", exit_grace=2
    )

    async def episode(ctx):
        async with ctx.borrow("env") as lease:
            for k in range(ctx.task["turns"]):
                r = await http.get(f"{ctx.sampler}/sample", params={"s": 0.02, "n": 3})
                body = r.raise_for_status().json()
                ctx.add_turn(stand_in_turn(ctx, k, body))
                async with lease.operation("step"):
                    await http.get(f"{lease.resource.url}/op", params={"s": ctx.task["step_s"][k]})
        return ctx.trajectory

    async def admit_all(driver: RolloutDriver) -> None:
        for i in range(max_tasks):
            task_id = f"task{i}"
            if task_id in done:
                continue
            turns = rng.randint(1, 3)
            task = {"turns": turns, "step_s": [rng.uniform(0.05, 1.2) for _ in range(turns)]}
            try:
                await driver.admit(GroupSpec(task_id, size=2, task=task))
            except AdmissionClosed:
                return
        driver.close_admission()

    async with httpx.AsyncClient(timeout=30) as http:
        await drive(
            resources,
            episode,
            interrupts,
            admit_all,
            sink_path=sink_path,
            policy=REF,
            ready={"resumed": len(done)},
            max_groups_in_flight=4,
        )


if __name__ == "__main__":
    run_dir, policy_url, seed = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    max_tasks = int(sys.argv[4]) if len(sys.argv) > 4 else 100_000
    raise SystemExit(run(lambda interrupts: main(interrupts, run_dir, policy_url, seed, max_tasks)))
