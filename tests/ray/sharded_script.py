"""A rollout script for the Ray signal tests: a `ShardedDriver` of two shards, under `run`.

    python sharded_script.py RUN_DIR POLICY_URL SEED [ADDRESS RESOURCE0 RESOURCE1]

It starts its own local Ray (`ray.init()` inside the driver, shut down when it closes), or
with ADDRESS joins that cluster (left running) and pins shard i to the node that has the
custom resource RESOURCEi.
Episodes sample from POLICY_URL (the op server) and run remote steps of random length on it
(`shard_parts.py`). Events go to stdout as JSON lines: ready, admitted (a group the driver
took), group (after the sink wrote it), and stats at the very end.
"""

from __future__ import annotations

import random
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))  # event_script

from event_script import emit, lease_counts, report_groups
from shard_parts import make_shard, placed_episode, task

from plies import AdmissionClosed, PolicyRef
from plies.runtime import GroupSpec, JsonlSink, ShardedDriver, run

REF = PolicyRef(uri="plies://ray-signals/policies/0", version=0)


async def main(
    interrupts, run_dir: Path, policy_url: str, seed: int, address: str | None, pins: list[str]
) -> None:
    rng = random.Random(seed)

    async def admit_all(driver: ShardedDriver) -> None:
        for i in range(100_000):
            turns = rng.randint(1, 3)
            spec = GroupSpec(f"task{i}", size=2, task=task(turns, 0.02, rng.uniform(0.05, 1.0)))
            try:
                await driver.admit(spec)
            except AdmissionClosed:
                return
            emit("admitted", id=spec.id)

    driver = ShardedDriver(
        partial(make_shard, policy_url, play=placed_episode),
        shards=2,
        address=address,
        shard_options=[{"resources": {name: 1}} for name in pins] or None,
        policy=REF,
        max_groups_in_flight=6,
        report_path=run_dir / "quarantine.json",
        exit_timeout=30,
    )
    try:
        with JsonlSink(run_dir / "groups.jsonl") as sink:
            driver.sink = sink
            async with driver:
                await report_groups(driver, interrupts, admit_all)
    finally:
        s = driver.statistics()
        emit(
            "stats",
            admitted_groups=s.admitted_groups,
            running=s.running,
            settled={k.value: v for k, v in s.settled.items()},
            shards_alive=sum(x.alive for x in driver.shard_statistics()),
            **lease_counts(s.leases),
        )


if __name__ == "__main__":
    run_dir, policy_url, seed = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    address, pins = (sys.argv[4], sys.argv[5:]) if len(sys.argv) > 4 else (None, [])
    raise SystemExit(
        run(lambda interrupts: main(interrupts, run_dir, policy_url, seed, address, pins))
    )
