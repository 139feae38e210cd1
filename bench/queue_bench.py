"""Thousands of requests at once: completion time and client-side overhead per request.

    python bench/queue_bench.py [--requests 16000] [--latency 0.1] [--clients raw aiohttp ...]

The stand-in engine of `bench/runtime_bench.py` (its own process) answers every request after
exactly L seconds. Each client sends `--requests` requests at once, twice: a cold burst, which
opens a connection for each, then a warm burst on the kept-alive connections. A request's
overhead is its latency minus L: what the client (and the stand-in's own queue, so this is an
upper bound on the client's share) added. "raw" is the minimal client of runtime_bench (bench
only); the others are `plies.policy.VLLMClient` on each transport. The collector is set as a
long run sets it (`long_run_collector`; `--collector default`: Python's thresholds). Target:
the default client's p99 overhead under 1 s with 16,000 requests in flight.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

from bench_kit import add_collector_argument, add_loop_argument, run_on

HERE = Path(__file__).resolve().parent


def _runtime_bench():
    spec = importlib.util.spec_from_file_location("runtime_bench", HERE / "runtime_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


async def burst(client, requests: int) -> tuple[float, list[float], list[str]]:
    """Send `requests` samples at once: the time until the last answer, latencies, failures."""
    import anyio

    from plies import PolicyRef
    from plies.policy import SamplingParams

    ref = PolicyRef(uri="plies://bench/policies/0", version=0)
    params = SamplingParams(max_tokens=8)
    latencies: list[float] = []
    failures: list[str] = []

    async def one(i: int) -> None:
        t = time.perf_counter()
        try:
            await client.sample([1, 2, 3, 4], params, policy=ref, session=f"episode-{i}")
        except Exception as e:  # counted and shown: a lost request is part of the result
            failures.append(f"{type(e).__name__}: {e}")
            return
        latencies.append(time.perf_counter() - t)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(requests):
            tg.start_soon(one, i)
    return time.perf_counter() - start, latencies, failures


async def measure(
    url: str, kind: str, requests: int, latency: float, bench, collector: str
) -> list[str]:
    from plies import PolicyRef, RetryPolicy
    from plies.policy import Timeout, VLLMClient
    from plies.runtime import long_run_collector

    if kind == "raw":
        host, port = url.removeprefix("http://").split(":")
        client = bench.RawClient(host, int(port))
    else:
        client = VLLMClient(
            url,
            "bench",
            policy=PolicyRef(uri="plies://bench/policies/0", version=0),
            timeout=Timeout(connect=60, read=120, write=60, pool=120),
            retry=RetryPolicy(attempts=1),
            transport=kind,
        )
    collect = long_run_collector() if collector == "long-run" else nullcontext()
    async with client:
        with collect:  # as `plies.runtime.run` sets it around a script's main, by default
            return await _bursts(client, kind, requests, latency)


async def _bursts(client, kind: str, requests: int, latency: float) -> list[str]:
    """A cold burst, then a warm one, each as one printed row (and its first failure)."""
    rows = []
    for name in ("cold", "warm"):
        cpu = time.process_time()
        took, latencies, failures = await burst(client, requests)
        cpu = time.process_time() - cpu
        over = sorted(x - latency for x in latencies) or [float("nan")]
        p50 = statistics.median(over)
        p99 = over[int(0.99 * (len(over) - 1))]
        rows.append(
            f"{kind:>9} {name:>5} {took:>9.2f}s {p50 * 1000:>9.0f}ms {p99 * 1000:>9.0f}ms "
            f"{over[-1] * 1000:>9.0f}ms {cpu:>7.2f}s {len(failures):>6}"
        )
        if failures:
            rows.append(f"        first failure: {failures[0]}")
    return rows


def main() -> None:
    bench = _runtime_bench()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16_000, help="requests at once")
    parser.add_argument("--latency", type=float, default=0.1, help="stand-in latency L, s")
    parser.add_argument(
        "--clients",
        nargs="+",
        default=list(bench.CLIENTS),
        choices=list(bench.CLIENTS),
        help="clients, each measured in a fresh event loop",
    )
    add_collector_argument(parser)
    add_loop_argument(parser)
    args = parser.parse_args()

    from plies.testing import serve_process_sync

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < args.requests + 512:  # a connection per request in flight, here and there
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    standin = [bench.__file__, "--serve", "--latency", str(args.latency)]
    with (
        tempfile.TemporaryDirectory() as tmp,
        serve_process_sync(
            [sys.executable, *standin], log=Path(tmp) / "engine.log", ready_timeout=60
        ) as engine,
    ):
        print(
            f"stand-in engine (bench only, separate process) at {engine.url}: answers after "
            f"L = {args.latency * 1000:g} ms; {args.requests} requests at once; "
            f"collector: {args.collector}; loop: {args.loop}; {os.cpu_count()} CPUs, "
            f"load average {os.getloadavg()[0]:.1f}"
        )
        for kind in args.clients:
            print(f"client {kind + ':':<10} {bench.CLIENTS[kind]}")
        print("overhead: latency - L, per request; CPU: the client process's, for the burst")
        header = ("client", "burst", "all done", "p50 over", "p99 over", "max over", "CPU")
        header = (*header, "failed")
        print("{:>9} {:>5} {:>10} {:>11} {:>11} {:>11} {:>8} {:>6}".format(*header))
        for kind in args.clients:
            for row in run_on(
                args.loop, measure, engine.url, kind, args.requests, args.latency, bench,
                args.collector,
            ):  # fmt: skip
                print(row, flush=True)
        print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
