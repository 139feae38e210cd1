"""Turns/s of rollout shards on Ray against one process, side by side, on the real path.

    python bench/shard_bench.py [--latency 0.1] [--concurrency 1024] [--shards 2] [--turns 8]
        [--distinct]

Needs the `plies[ray]` extra. Both rows run what `rollout_bench.py`'s "harness" path runs,
imported from it: `ToolCallingHarness` + `ChatRenderer` on TRL's `qwen3_training` template +
its parser + `CounterEnv` (one tool) + `EnvPool`, a `JsonlSink` (each group fsynced before it
is handed out) and a quarantine report path, sampling from its IN-PROCESS SCRIPTED POLICY
(bench only: `sample` waits exactly L seconds and returns a fixed tool call).

- "1 process": `rollout_bench.measure` itself: one `RolloutDriver`, C episodes in flight.
- "N shards": a `ShardedDriver` with N Ray actors on a local Ray (`ray.init()`), C episodes
  in flight in all (C/N per shard); each actor builds its own tokenizer, renderer, harness,
  scripted policy and pool from a factory; the head admits, writes every group to its sink
  and checks each one as the one-process row does (completed, all turns).

C is chosen so that one process is CPU bound (it reaches far less than C/L turns/s). The
rows alternate, `--repeat` pairs (each sharded row on a Ray of its own, shut down before the
next one-process row), and the median ratio closes. Each row keeps C episodes in flight for
a warm-up, then counts turns over a window. Printed:
turns/s, share of ideal (C/L), CPU per turn (one process: its CPU time; shards: the head's
plus every shard's, as each last reported it), and the ratio of N shards to one process,
with the load average. On a shared machine the ratio leans on the load: other processes
take cores from both rows, and the scheduler shares CPU out per process, so N shards get a
larger share of a contended machine than one process does. CPU per turn says whether
sharding added work.

Target (issue 13): 2 shards >= 1.6x one process on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).parent))  # rollout_bench; Ray workers get it too

import rollout_bench
from bench_kit import check_completed, drive_until, window_rates, with_task
from rollout_bench import REF, SYSTEM, CounterEnv, ScriptedPolicy

from plies.harness import EpisodeLimits, ToolCallingHarness
from plies.policy import SamplingParams
from plies.runtime import EnvPool, JsonlSink, ShardedDriver, ShardSetup
from plies.tokens import ChatRenderer


async def make_env(goal: int, distinct: bool) -> CounterEnv:
    return CounterEnv(goal=goal, distinct=distinct)


@asynccontextmanager
async def make_shard(options: dict[str, Any], limit: int, index: int) -> AsyncIterator[ShardSetup]:
    """One shard of the harness path, built in its actor as `rollout_bench.measure` builds it."""
    setup = rollout_bench.load_setup(SimpleNamespace(**options))
    policy = ScriptedPolicy(setup.ids, setup.latency)
    harness = ToolCallingHarness(
        ChatRenderer(setup.tok),
        policy,
        SamplingParams(max_tokens=32),
        limits=EpisodeLimits(max_turns=setup.turns),
        system_prompt=SYSTEM,
    )
    pool = EnvPool(partial(make_env, setup.turns, setup.distinct), limit=limit)
    yield ShardSetup(harness.play, pools=[pool], sampler=policy)


async def measure_sharded(
    options: dict[str, Any], setup: rollout_bench.Setup, concurrency: int, shards: int
) -> tuple[int, float, float, float]:
    """Turns counted over the window, its length, and the CPU time over it of the head and
    of every shard together, with `shards` actors."""
    factory = partial(make_shard, options, -(-concurrency // shards))
    marks: list[int] = []
    head: list[float] = []
    cpu: list[float] = []
    with tempfile.TemporaryDirectory() as tmp, JsonlSink(Path(tmp) / "groups.jsonl") as sink:
        async with ShardedDriver(
            factory,
            shards=shards,
            policy=REF,
            max_groups_in_flight=concurrency,
            sink=sink,
            report_path=Path(tmp) / "quarantine.json",
        ) as d:
            t0 = time.perf_counter()
            warmup = setup.warmup_for(concurrency)
            t_a, t_b = t0 + warmup, t0 + warmup + setup.window

            async def clock() -> None:
                for t in (t_a, t_b):
                    await anyio.sleep(t - time.perf_counter())
                    marks.append(d.statistics().turns)
                    shards_cpu = sum(s.cpu_s for s in d.shard_statistics())
                    head.append(time.process_time())
                    cpu.append(shards_cpu)

            await drive_until(
                d, t_b, partial(check_completed, turns=setup.turns), clock, spec=with_task
            )
            done = d.statistics()
        assert done.leases.balanced and done.leases.released == done.settled_total
    return marks[1] - marks[0], t_b - t_a, head[1] - head[0], cpu[1] - cpu[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--latency", type=float, default=0.1, help="policy latency L, s")
    parser.add_argument("--concurrency", type=int, default=1024, help="C, episodes in flight")
    parser.add_argument("--shards", type=int, default=2, help="Ray actors")
    parser.add_argument("--turns", type=int, default=8, help="turns per episode")
    parser.add_argument("--warmup", type=float, help="seconds before the window")
    parser.add_argument("--window", type=float, default=6.0, help="seconds measured")
    parser.add_argument("--template", default="qwen3_training", help="a TRL template name")
    parser.add_argument(
        "--distinct", action="store_true", help="no observation ever repeats (rollout_bench)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="pairs of rows, alternating")
    args = parser.parse_args()
    keys = ("latency", "turns", "warmup", "window", "template", "distinct")
    options = {k: getattr(args, k) for k in keys}
    setup = rollout_bench.load_setup(args)
    c, ideal = args.concurrency, args.concurrency / args.latency
    print(
        f"harness path, scripted in-process policy (bench only): L = {args.latency * 1000:g} ms, "
        f"{args.turns} turns/episode{', distinct tool results' if args.distinct else ''}, "
        f"C = {c}, ideal {ideal:.0f} turns/s; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} before",
        flush=True,
    )
    # Each sharded row starts its own local Ray and shuts it down, so no Ray process runs
    # beside the one-process rows.
    ratios = []
    for _ in range(args.repeat):
        row = anyio.run(rollout_bench.measure, setup, "harness", c)
        one, cpu_us = window_rates(row.window_turns, row.window_s, row.window_cpu_s)
        print(
            f"{'1 process':>10}: {one:>7.0f} turns/s  {one / ideal:>6.1%} of ideal  "
            f"{cpu_us:.0f} us CPU/turn, {row.window_cpu_s / row.window_s:.2f} cores used; "
            f"load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        turns, window, head_s, shards_s = anyio.run(measure_sharded, options, setup, c, args.shards)
        many = turns / window
        per_turn = (head_s + shards_s) / max(turns, 1) * 1e6
        print(
            f"{f'{args.shards} shards':>10}: {many:>7.0f} turns/s  {many / ideal:>6.1%} of "
            f"ideal  {per_turn:.0f} us CPU/turn (head {head_s / max(turns, 1) * 1e6:.0f}), "
            f"{(head_s + shards_s) / window:.2f} cores used; "
            f"load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        ratios.append(many / one)
        print(f"ratio {args.shards} shards / 1 process: {many / one:.2f}x", flush=True)
    print(
        f"median ratio over {len(ratios)} pairs: {statistics.median(ratios):.2f}x (target >= 1.6x)"
    )


if __name__ == "__main__":
    main()
