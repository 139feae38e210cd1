"""The runtime's own overhead: achieved turns/s against the ideal C/L, and client CPU per turn.

    python bench/runtime_bench.py [--latency 0.1] [--concurrency 1 8 64 256 512] [--turns 10]

A STAND-IN ENGINE (this bench only) answers every `/v1/completions` request after exactly L
seconds with a fixed 8-token completion. It runs in its own process, so its CPU is not the
client's. The client side is the real runtime: `RolloutResources` + `RolloutDriver`, C
episodes in flight, each borrowing a lease from an `EnvPool` and taking `--turns` turns; each
turn samples inside `lease.operation("sample")` and is recorded with `ctx.add_turn`. Two
clients are measured side by side: "raw" (one keep-alive TCP connection per lease, a minimal
HTTP/1.1 exchange: the runtime's own overhead) and "vllm" (`plies.policy.VLLMClient`,
httpx). With no overhead a run achieves C/L turns/s; the ratio printed is achieved / ideal,
measured side by side in one run. Target: >= 90% at C=256, L=100 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

STANDIN_TOKENS = 8


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


def serve_standin(latency: float) -> None:
    ids = list(range(100, 100 + STANDIN_TOKENS))
    payload = json.dumps(
        {
            "choices": [
                {
                    "token_ids": ids,
                    "logprobs": {"token_logprobs": [-0.5] * len(ids)},
                    "finish_reason": "length",
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


class RawSampler:
    """A minimal keep-alive HTTP/1.1 client on one anyio TCP stream (bench only).

    It isolates the runtime's own overhead from the HTTP library's: one connection per
    episode, created and torn down by the `EnvPool`.
    """

    def __init__(self, stream, host: str, body: bytes):
        self.stream = stream
        self.request = (
            f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json"
            f"\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode() + body
        self.buf = b""

    async def sample(self) -> dict:
        await self.stream.send(self.request)
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
        return json.loads(body)

    async def aclose(self) -> None:
        await self.stream.aclose()


async def measure(
    url: str, concurrency: int, turns: int, rounds: int, client_kind: str
) -> tuple[int, float, float]:
    """Run `concurrency * rounds` episodes of `turns` turns; return (turns, wall s, cpu s)."""
    import anyio

    from plies import PolicyRef, Turn
    from plies.policy import RetryPolicy, SamplingParams, Timeout, VLLMClient
    from plies.runtime import EnvPool, GroupSpec, RolloutDriver, RolloutResources

    ref = PolicyRef(uri="plies://bench/policies/0", version=0)
    params = SamplingParams(max_tokens=STANDIN_TOKENS)
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "bench", "prompt": [1, 2, 3, 4], "max_tokens": 8}).encode()

    async def connect() -> RawSampler:
        return RawSampler(await anyio.connect_tcp(host, int(port)), host, body)

    class Nothing:
        async def aclose(self) -> None:
            await anyio.lowlevel.checkpoint()

    async def nothing() -> Nothing:
        return Nothing()

    async def episode(ctx):
        prompt = [1, 2, 3, 4]
        async with ctx.borrow("env") as lease:
            for k in range(turns):
                async with lease.operation("sample"):
                    if client_kind == "raw":
                        choice = (await lease.resource.sample())["choices"][0]
                        ids, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
                        reason, policy = choice["finish_reason"], ctx.policy_ref
                    else:
                        c = await ctx.policy.sample(prompt, params, policy=ctx.policy_ref)
                        ids, logprobs, reason, policy = c.ids, c.logprobs, c.finish_reason, c.policy
                ctx.add_turn(
                    Turn(
                        prompt_ids=prompt if k == 0 else [5],
                        extends=k > 0,
                        completion_ids=ids,
                        logprobs=logprobs,
                        finish_reason=reason,
                        policy=policy,
                    )
                )
        return ctx.trajectory

    client = VLLMClient(
        url,
        "bench",
        policy=ref,
        timeout=Timeout(connect=30, read=60, write=30, pool=60),
        retry=RetryPolicy(attempts=1),
    )
    pool = EnvPool(connect if client_kind == "raw" else nothing, limit=concurrency)
    async with client, RolloutResources(policy=client, pools=[pool]) as res:
        if client_kind == "vllm":  # warm the connection pool: time the steady state
            async with anyio.create_task_group() as tg:
                for _ in range(concurrency):
                    tg.start_soon(client.sample, [1], params)
        cpu0, t0 = time.process_time(), time.perf_counter()
        async with RolloutDriver(res, episode, policy=ref, max_groups_in_flight=concurrency) as d:

            async def admit() -> None:
                for i in range(concurrency * rounds):
                    await d.admit(GroupSpec(f"t{i}"))
                d.close_admission()

            async with anyio.create_task_group() as tg:
                tg.start_soon(admit)
                async for group in d.groups():
                    assert group.trajectories[0].status.value == "completed", group
            done = d.poll()
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        assert done.leases.balanced and done.leases.released == concurrency * rounds
    return done.turns, wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--latency", type=float, default=0.1, help="stand-in latency L, s")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 8, 64, 256, 512], help="values of C"
    )
    parser.add_argument("--turns", type=int, default=10, help="turns per episode")
    parser.add_argument("--rounds", type=int, default=2, help="episodes per slot")
    parser.add_argument(
        "--clients", nargs="+", default=["raw", "vllm"], choices=["raw", "vllm"], help="clients"
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve_standin(args.latency)
        return

    import anyio

    engine = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--latency", str(args.latency)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = json.loads(engine.stdout.readline())["url"]
        print(
            f"stand-in engine (bench only, separate process) at {url}: answers after "
            f"L = {args.latency * 1000:g} ms; {args.turns} turns/episode, {args.rounds} "
            f"episodes per slot; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
        )
        print("client raw:  RolloutDriver + EnvPool (one keep-alive TCP connection per lease)")
        print("client vllm: RolloutDriver + EnvPool + plies.policy.VLLMClient (httpx)")
        header = ("client", "C", "ideal t/s", "achieved", "ratio", "CPU/turn")
        print("{:>6} {:>5} {:>10} {:>10} {:>7} {:>10}".format(*header))
        for c in args.concurrency:
            for kind in args.clients:
                turns, wall, cpu = anyio.run(measure, url, c, args.turns, args.rounds, kind)
                ideal = c / args.latency
                achieved = turns / wall
                print(
                    f"{kind:>6} {c:>5} {ideal:>10.0f} {achieved:>10.0f} "
                    f"{achieved / ideal:>7.1%} {cpu / turns * 1e6:>8.0f}us",
                    flush=True,
                )
    finally:
        engine.kill()
        engine.wait()


if __name__ == "__main__":
    main()
