"""The runtime's own overhead: achieved turns/s against the ideal C/L, and client CPU per turn.

    python bench/runtime_bench.py [--latency 0.1] [--concurrency 1 8 64 256 512] [--turns 10]

A STAND-IN ENGINE (this bench only) answers every `/v1/completions` request after exactly L
seconds with a fixed 8-token completion. It runs in its own process, so its CPU is not the
client's. The client side is the real runtime: `RolloutResources` + `RolloutDriver` keep C
episodes in flight, each borrowing a lease from an `EnvPool` and taking `--turns` turns; each
turn samples through `ctx.sampler` inside `lease.operation("sample")` and is recorded with
`ctx.add_turn`. A slot whose episode settles starts the next one, so admission, borrowing,
teardown and settling are measured along with the turns.

Policy clients measured side by side: "raw", a minimal keep-alive HTTP/1.1 client (what
remains is the runtime's own overhead), and `plies.policy.VLLMClient` on each transport
("httptools", the default; "aiohttp"; "httpx2"; "httpx"). Turns are counted in a window after
a warm-up, when all C episodes have started; with no overhead a run achieves C/L turns/s, and
the ratio printed is achieved / ideal, then achieved / raw's achieved at the same C. The cyclic
collector is set as `plies.runtime.run` sets it for a script's main (`long_run_collector`),
since that is the path a real run takes; `--collector default` keeps Python's thresholds,
which cost the default client more than the minimal one (it allocates more a request). The
loop is asyncio's own, as `plies.runtime.run` runs a script; `--loop uvloop` compares uvloop.
Targets (L = 100 ms): raw >= 90% of ideal at C=256; the default client >= 85% of raw at C=256
and C=1024, and >= 80% of ideal at C=256.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from bench_kit import (
    add_collector_argument,
    add_load_arguments,
    add_loop_argument,
    bare_episode,
    drive_until,
    nothing,
    run_on,
    window_rates,
)

STANDIN_TOKENS = 8
CLIENTS = {
    "raw": "a minimal HTTP/1.1 client (bench only)",
    "httptools": "VLLMClient, httptools transport (the default)",
    "aiohttp": "VLLMClient, aiohttp transport",
    "httpx2": "VLLMClient, httpx2 transport",
    "httpx": "VLLMClient, httpx transport",
}


# -- the stand-in engine (separate process) ----------------------------------------------------


class _StandInEngine(asyncio.Protocol):
    """HTTP/1.1 keep-alive; every request is answered after `latency` seconds."""

    def __init__(self, latency: float, body: bytes):
        self.latency = latency
        self.body = body
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buf[:head_end].lower()
            length = 0
            for line in head.split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            end = head_end + 4 + length
            if len(self.buf) < end:
                return
            self.buf = self.buf[end:]
            asyncio.get_running_loop().call_later(self.latency, self._answer)

    def _answer(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(self.body)


def serve_standin(latency: float, ids: list[int] | None = None, finish: str = "length") -> None:
    """Serve the stand-in engine; prints `{"url": ...}` once listening.

    `ids`: the completion every request gets (default: 8 arbitrary ids, cut at the limit);
    `gateway_bench.py` passes a well-formed Qwen3 reply that ends with its stop token.
    """
    ids = ids if ids is not None else list(range(100, 100 + STANDIN_TOKENS))
    payload = json.dumps(
        {
            "choices": [
                {
                    "token_ids": ids,
                    "logprobs": {"token_logprobs": [-0.5] * len(ids)},
                    "finish_reason": finish,
                }
            ],
            "plies_policy": {"uri": "plies://bench/policies/0", "version": 0, "digest": ""},
        }
    ).encode()
    body = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(payload)}\r\n\r\n".encode()
        + payload
    )

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: _StandInEngine(latency, body), "127.0.0.1", 0, backlog=4096
        )
        port = server.sockets[0].getsockname()[1]
        print(json.dumps({"url": f"http://127.0.0.1:{port}"}), flush=True)
        await server.serve_forever()

    asyncio.run(main())


# -- the client: the real runtime ---------------------------------------------------------------


class _Connection:
    """One keep-alive HTTP/1.1 connection: send a request, read one whole response."""

    def __init__(self, stream):
        self.stream = stream
        self.buf = b""

    async def exchange(self, request: bytes) -> bytes:
        await self.stream.send(request)
        while (head_end := self.buf.find(b"\r\n\r\n")) < 0:
            self.buf += await self.stream.receive()
        length = 0
        for line in self.buf[:head_end].lower().split(b"\r\n"):
            if line.startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        end = head_end + 4 + length
        while len(self.buf) < end:
            self.buf += await self.stream.receive()
        body, self.buf = self.buf[head_end + 4 : end], self.buf[end:]
        return body


class RawClient:
    """A minimal policy client (bench only): keep-alive connections kept on a free list.

    It speaks the same `/v1/completions` exchange as `VLLMClient` and returns the same
    validated `Completion`, without an HTTP library: what it costs is the runtime's floor.
    """

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.idle: list[_Connection] = []
        self.open: list[_Connection] = []

    async def sample(self, prompt_ids, params, *, policy=None, session=None):
        import anyio

        from plies.policy import Completion

        body = json.dumps(
            {"model": "bench", "prompt": list(prompt_ids), "max_tokens": params.max_tokens}
        ).encode()
        request = (
            f"POST /v1/completions HTTP/1.1\r\nhost: {self.host}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode() + body
        if self.idle:
            conn = self.idle.pop()
        else:
            conn = _Connection(await anyio.connect_tcp(self.host, self.port))
            self.open.append(conn)
        reply = json.loads(await conn.exchange(request))
        self.idle.append(conn)
        choice = reply["choices"][0]
        return Completion(
            ids=choice["token_ids"],
            logprobs=choice["logprobs"]["token_logprobs"],
            finish_reason=choice["finish_reason"],
            policy=policy,
        )

    async def __aenter__(self) -> RawClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        for conn in self.open:
            await conn.stream.aclose()


@dataclass
class Row:
    """One measured run: the steady window, and how the run started."""

    window_turns: int
    window_s: float
    window_cpu_s: float
    start_s: float
    """When the C-th turn was recorded: the cost of starting C episodes in one burst."""
    failed: list[str]
    """The error of each episode that failed (a lost request), in the order they settled."""


async def measure(
    url: str,
    concurrency: int,
    turns: int,
    warmup: float,
    window: float,
    client_kind: str,
    collector: str = "long-run",
) -> Row:
    """Keep `concurrency` episodes of `turns` turns in flight for `warmup + window` seconds.

    Every slot starts a new episode as soon as its last one settles, so episode turnover
    (admission, borrow, create, teardown, settle) happens inside the window. Turns are
    counted by the moment they were recorded. The first `warmup` seconds, when all C episodes
    start in one burst, and the final drain are outside the window; the burst is reported as
    the moment the C-th turn was recorded (ideally L).
    """
    import anyio

    from plies import PolicyRef, RetryPolicy
    from plies.policy import SamplingParams, Timeout, VLLMClient
    from plies.runtime import EnvPool, RolloutResources, long_run_collector

    ref = PolicyRef(uri="plies://bench/policies/0", version=0)
    params = SamplingParams(max_tokens=STANDIN_TOKENS)
    host, port = url.removeprefix("http://").split(":")
    recorded: list[float] = []
    episode = bare_episode(turns, params, recorded)

    if client_kind == "raw":
        client = RawClient(host, int(port))
    else:
        client = VLLMClient(
            url,
            "bench",
            policy=ref,
            timeout=Timeout(connect=30, read=60, write=30, pool=60),
            retry=RetryPolicy(attempts=1),
            transport=client_kind,
        )
    pool = EnvPool(nothing, limit=concurrency)
    async with client, RolloutResources(sampler=client, pools=[pool]) as res:
        async with anyio.create_task_group() as tg:  # open the connections before the clock
            for _ in range(concurrency):
                tg.start_soon(partial(client.sample, [1], params, policy=ref))
        collect = long_run_collector() if collector == "long-run" else nullcontext()
        with collect:  # as `plies.runtime.run` sets it around a script's main, by default
            return await _window(res, episode, ref, concurrency, warmup, window, recorded)


async def _window(
    res, episode, ref, concurrency: int, warmup: float, window: float, recorded: list[float]
) -> Row:
    """The measured part of `measure`: C episodes kept in flight, turns counted in the window."""
    import anyio

    from plies import Group
    from plies.runtime import RolloutDriver

    cpu: list[float] = []
    failed: list[str] = []
    t0 = time.perf_counter()
    t_a, t_b = t0 + warmup, t0 + warmup + window

    async def clock() -> None:
        for t in (t_a, t_b):
            await anyio.sleep(t - time.perf_counter())
            cpu.append(time.process_time())

    def settled(group: Group) -> None:
        trajectory = group.trajectories[0]
        if trajectory.status.value != "completed":
            failed.append(trajectory.error or trajectory.status.value)

    async with RolloutDriver(res, episode, policy=ref, max_groups_in_flight=concurrency) as d:
        await drive_until(d, t_b, settled, clock)
        done = d.statistics()
    assert done.leases.balanced and done.leases.released == done.settled_total, done
    in_window = sum(t_a <= t < t_b for t in recorded)
    return Row(in_window, t_b - t_a, cpu[1] - cpu[0], recorded[concurrency - 1] - t0, failed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_load_arguments(
        parser, latency="stand-in", concurrency=[256, 1024, 4096], turns=10, warmup=1.0
    )
    parser.add_argument(
        "--clients", nargs="+", default=list(CLIENTS), choices=list(CLIENTS), help="clients"
    )
    add_collector_argument(parser)
    add_loop_argument(parser)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve_standin(args.latency)
        return

    from plies.testing import serve_process_sync

    standin = [sys.executable, __file__, "--serve", "--latency", str(args.latency)]
    with (
        tempfile.TemporaryDirectory() as tmp,
        serve_process_sync(standin, log=Path(tmp) / "engine.log", ready_timeout=60) as engine,
    ):
        url = engine.url
        print(
            f"stand-in engine (bench only, separate process) at {url}: answers after "
            f"L = {args.latency * 1000:g} ms; {args.turns} turns/episode; window "
            f"{args.window:g} s after {args.warmup:g} s; "
            f"collector: {args.collector}; loop: {args.loop}; "
            f"{os.cpu_count()} CPUs, "
            f"load average {os.getloadavg()[0]:.1f}"
        )
        for kind in args.clients:
            print(f"client {kind + ':':<10} RolloutDriver + EnvPool + {CLIENTS[kind]}")
        print(
            "achieved: turns recorded in the window; /raw: achieved over raw's at the same C; "
            "C-th turn: when the burst start ended; failed: episodes lost to a failed request"
        )
        header = (
            *("client", "C", "ideal t/s", "achieved", "/ideal", "/raw", "CPU/turn"),
            *("C-th turn", "failed"),
        )
        print("{:>9} {:>5} {:>10} {:>9} {:>7} {:>7} {:>9} {:>10} {:>6}".format(*header))
        for c in args.concurrency:
            raw = None
            for kind in args.clients:
                row = run_on(
                    args.loop, measure, url, c, args.turns, args.warmup, args.window, kind,
                    args.collector,
                )  # fmt: skip
                ideal = c / args.latency
                achieved, cpu_us = window_rates(row.window_turns, row.window_s, row.window_cpu_s)
                if kind == "raw":
                    raw = achieved
                vs_raw = f"{achieved / raw:>7.1%}" if raw else f"{'-':>7}"
                print(
                    f"{kind:>9} {c:>5} {ideal:>10.0f} {achieved:>9.0f} {achieved / ideal:>7.1%} "
                    f"{vs_raw} {cpu_us:>7.0f}us {row.start_s * 1000:>8.0f}ms "
                    f"{len(row.failed):>6}",
                    flush=True,
                )
                if row.failed:
                    print(f"        first failure: {row.failed[0]}", flush=True)
        print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
