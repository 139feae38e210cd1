"""The gateway at fleet scale: C agent sessions through `plies gateway`, against the ideal C/L.

    python bench/gateway_bench.py [--latency 0.1] [--concurrency 64 256] [--turns 8]

Three processes. The stand-in engine of `runtime_bench.py` answers every `/v1/completions`
after exactly L seconds with one well-formed Qwen3 reply (an empty think block, a sentence,
the stop token: `REPLY`), so each turn's reply is re-rendered into the same ids and the next
turn can extend it, as with a real model. `plies gateway` is the real command: the offline Qwen3
tokenizer and chat template, the renderer, the parser, `VLLMClient` on its default transport,
a session per agent. This process plays C agents at once, each one session of `--turns` chat
turns sent as an agent sends them: the whole history every turn, each user message naming
the agent and the turn (distinct content, so nothing is served from the renderer's memo),
the assistant's reply appended as it came back. An agent whose session ends starts the next.

Printed per C: turns/s in a window after every agent has started, against the ideal C/L;
the gateway process's CPU per turn (from /proc, over the same window); how many turns
extended the stored tokens; and failed requests. Target (L = 100 ms): >= 70% of ideal at
C = 256. `--profile` runs the gateway under cProfile (slower) and prints what its main steps
cost per turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

HERE = Path(__file__).parent
ROOT = HERE.parent
TICKS = os.sysconf("SC_CLK_TCK")
REPLY = "<think>\n\n</think>\n\nThe value is reported.<|im_end|>"


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


@dataclass
class Counts:
    turns: int = 0
    failed: int = 0
    extended: int = 0
    sessions: int = 0


async def agent(
    http: aiohttp.ClientSession,
    url: str,
    admin: dict[str, str],
    name: int,
    turns: int,
    counts: Counts,
    stop: asyncio.Event,
) -> None:
    """One agent after another in this slot, each a session of `turns` chat turns."""
    episode = 0
    while not stop.is_set():
        episode += 1
        async with http.post(f"{url}/sessions", json={"task_id": f"a{name}"}, headers=admin) as r:
            key = (await r.json())["key"]
        auth = {"Authorization": f"Bearer {key}"}
        messages = [{"role": "system", "content": "You are a terse agent."}]
        for turn in range(turns):
            text = f"Agent {name}, episode {episode}, turn {turn}: report the value {name * turn}."
            messages.append({"role": "user", "content": text})
            body = {"model": "bench", "messages": messages}
            async with http.post(f"{url}/chat/completions", json=body, headers=auth) as r:
                if r.status != 200:
                    counts.failed += 1
                    break
                reply = (await r.json())["choices"][0]["message"]
            messages.append({"role": "assistant", "content": reply.get("content") or ""})
            counts.turns += 1
        path = f"{url}/sessions/{key}/finish"
        async with http.post(path, json={"reward": 0.0}, headers=admin) as r:
            trajectory = await r.json()
        counts.extended += sum(1 for t in trajectory["turns"] if t.get("extends"))
        counts.sessions += 1


async def measure(url: str, token: str, concurrency: int, turns: int, latency: float, pid: int):
    counts = Counts()
    stop = asyncio.Event()
    admin = {"Authorization": f"Bearer {token}"}
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        tasks = [
            asyncio.create_task(agent(http, url, admin, k, turns, counts, stop))
            for k in range(concurrency)
        ]
        warm = max(2.0, 3 * latency * turns / 2)
        await asyncio.sleep(warm)
        t0, n0, c0 = time.monotonic(), counts.turns, cpu_seconds(pid)
        await asyncio.sleep(max(5.0, 40 * latency))
        t1, n1, c1 = time.monotonic(), counts.turns, cpu_seconds(pid)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    achieved = (n1 - n0) / (t1 - t0)
    ideal = concurrency / latency
    per_turn_us = (c1 - c0) / max(n1 - n0, 1) * 1e6
    later = counts.turns - counts.sessions  # every turn after a session's first
    return {
        "C": concurrency,
        "achieved_turns_per_s": round(achieved, 1),
        "ideal_turns_per_s": round(ideal, 1),
        "of_ideal": round(achieved / ideal, 3),
        "gateway_cpu_us_per_turn": round(per_turn_us),
        "later_turns_extended": f"{counts.extended}/{later}",
        "failed_requests": counts.failed,
        "turns_in_all": counts.turns,
    }


def start(argv: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env, cwd=HERE)
    line = proc.stdout.readline() if proc.stdout else ""
    if not line:
        proc.kill()
        raise SystemExit(f"{argv[:3]} did not start")
    return proc, json.loads(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency", type=float, default=0.1)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument(
        "--profile", action="store_true", help="run the gateway under cProfile; print its steps"
    )
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from plies import testing

    tokenizer = testing.qwen3_tokenizer_dir()
    ids = AutoTokenizer.from_pretrained(tokenizer).encode(REPLY, add_special_tokens=False)
    serve = f"serve_standin({args.latency}, {ids}, 'stop')"
    engine, where = start(
        [sys.executable, "-c", f"from runtime_bench import serve_standin; {serve}"]
    )
    profile = Path(tempfile.mkdtemp()) / "gateway.prof"
    if args.profile:
        command = [sys.executable, "-m", "cProfile", "-o", str(profile), "-m", "plies"]
    else:
        command = [str(Path(sys.executable).with_name("plies"))]
    gateway, served = start(
        [
            *command,
            "gateway",
            "--sampler",
            where["url"],
            "--tokenizer",
            str(tokenizer),
            "--model",
            "bench",
        ]
    )
    total = 0
    try:
        print(
            f"L = {args.latency * 1000:.0f} ms, {args.turns} turns a session, "
            f"{len(ids)} tokens a reply"
        )
        for c in args.concurrency:
            row = asyncio.run(
                measure(
                    served["url"], served["admin_token"], c, args.turns, args.latency, gateway.pid
                )
            )
            print(json.dumps(row), flush=True)
            total += row["turns_in_all"]
    finally:
        for proc in (gateway, engine):
            proc.terminate()
            proc.wait(timeout=30)
    if args.profile:
        print_profile(profile, total)


PROFILED = {
    "render the new messages (chat template)": "_template.py:134(text_of)",
    "render a turn in all": "_renderer.py:369(arender)",
    "sample through the client": "_http.py:207(sample)",
    "append the completion": "_renderer.py:391(add_completion)",
    "parse the completion": "_parser.py:157(parse)",
    "translate the request": "_chat.py:91(translate)",
}
"""What `--profile` reports, per chat turn: the gateway's steps by the function that does them."""


def print_profile(path: Path, turns: int) -> None:
    """Each step's cumulative CPU time per chat turn in the gateway (cProfile), over `turns`,
    every turn the agents took while it ran."""
    import pstats

    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    found = {f"{Path(k[0]).name}:{k[1]}({k[2]})": v for k, v in stats.items()}
    for what, key in PROFILED.items():
        cumulative = found[key][3] if key in found else 0.0
        print(f"{what}: {cumulative / max(turns, 1) * 1e6:.0f} µs a turn")


if __name__ == "__main__":
    main()
