"""Rollout throughput on the real path, side by side with the runtime's bare episode.

    python bench/rollout_bench.py [--latency 0.1] [--concurrency 32 256 1024] [--turns 8]
        [--template qwen3_training] [--distinct] [--profile PATH] [--python-gc]

Both paths sample from one IN-PROCESS SCRIPTED POLICY (this bench only): every `sample`
waits exactly L seconds (an `anyio.sleep`, no CPU) and returns the same tool call, validated
into a `Completion` as a real client does. C episodes of `--turns` turns stay in flight; a
slot whose episode settles starts the next, so admission, borrow, teardown, settling and the
sink are measured with the turns. With no overhead a run achieves C/L turns/s.

- "bare": `runtime_bench.py`'s episode: borrow a lease, sample `--turns` times inside
  `lease.operation("sample")`, record each turn. No renderer, parser, tool or sink.
- "harness": what a run takes: `ToolCallingHarness.play` with a `ChatRenderer` on a
  prefix-preserving template (TRL's `qwen3_training`), the template's response parser on
  every completion, an `Env` whose one tool is called every turn (done after `--turns`
  calls), `RolloutDriver` + `EnvPool`, a `JsonlSink` (every group written and fsynced before
  it is handed out) and a quarantine report path. The bench checks that every later turn took
  the incremental path (no fallback) and that every episode completed. Its observations
  repeat (`at 3`), as most envs' do, so the renderer's memos serve most steps and parses;
  `--distinct` makes every tool result name its episode, so that none is ever seen twice:
  what an env whose observations never repeat pays.

Printed per C: turns/s in a window after a warm-up, its share of ideal, CPU per turn
(process CPU time over the window, all threads, divided by the turns in it), and the event
loop's worst stall (how late a 5 ms sleep in a probe task woke up), and how many incremental
steps and parses the renderer's memos served. CPU time, not wall time,
is the figure to trust on a shared machine: other processes slow the wall clock, not the
CPU a turn costs here.

Then, for each harness row, a second run with per-stage instrumentation splits the CPU per
turn by stage (exclusive CPU time of each call, in whichever thread it ran): render
(`Conversation.arender` / `render`), parse (`Conversation.add_completion`), tool
(`Env.call_tool`, `Conversation.add_messages`), record (`Turn.from_completion`,
`EpisodeContext.add_turn`), sink (`JsonlSink.write` and `sync`, run by the resources scope's
writer thread), the scripted policy's own `sample` (not plies), the cyclic garbage
collector's passes (gc: whoever allocates triggers them, so they get their own column), and
the rest: the driver, pools, leases, anyio and thread hand-offs. `--profile PATH` also runs
cProfile (main thread and worker threads) in that run and writes merged stats to PATH.

Targets (issue 13), one process, harness path, C=256, L=100 ms: >= 70% of ideal and
<= 0.5 ms CPU per turn.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import os
import pstats
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import anyio
import trl
from bench_kit import (
    add_load_arguments,
    bare_episode,
    check_completed,
    drive_until,
    nothing,
    window_rates,
    with_task,
)
from pydantic import Field
from transformers import AutoTokenizer

from plies import Group, PolicyRef, Turn
from plies.environments import Env, Observation, Task, ToolResult, tool
from plies.harness import EpisodeLimits, ToolCallingHarness
from plies.policy import Completion, SamplingParams
from plies.runtime import (
    EnvPool,
    EpisodeContext,
    JsonlSink,
    RolloutDriver,
    RolloutResources,
    long_run_collector,
)
from plies.testing import qwen3_tokenizer_dir
from plies.tokens import ChatRenderer, Conversation

REF = PolicyRef(uri="plies://bench/policies/0", version=0)
SYSTEM = "You are a counter. Call the advance tool until the counter reaches the goal."
STALL_PERIOD = 0.005


# -- the parts ----------------------------------------------------------------------------------


class CounterEnv(Env):
    """One tool; the episode is done after `goal` calls. `distinct`: every result also names
    the episode's task, so that no two episodes ever see the same observation."""

    def __init__(self, goal: int, distinct: bool = False):
        super().__init__()
        self.goal = goal
        self.count = 0
        self.distinct = distinct
        self.tag = ""

    async def setup(self, task: Task) -> Observation:
        self.tag = f" (episode {task.id})" if self.distinct else ""
        return Observation(messages=[{"role": "user", "content": f"Count to {self.goal}."}])

    @tool
    async def advance(self, steps: Annotated[int, Field(ge=1, le=4)]) -> ToolResult:
        """Move the counter forward."""
        self.count += steps
        if self.count >= self.goal:
            return ToolResult(content=f"reached {self.count}{self.tag}", reward=1.0, done=True)
        return ToolResult(content=f"at {self.count}{self.tag}")


ADVANCE = {
    "type": "function",
    "function": {"name": "advance", "arguments": {"steps": 1}},
}


def scripted_completion(tok: Any, tools: list[dict[str, Any]]) -> list[int]:
    """The ids a model trained on the template samples for one `advance` call, close included.

    Taken from a full render after a tool round (what every later turn of the episode sees),
    so the renderer's local check that the sampled ids are canonical holds.
    """
    head = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Count to 8."},
        {"role": "assistant", "content": "", "tool_calls": [ADVANCE]},
        {"role": "tool", "name": "advance", "content": "at 1"},
    ]
    call = {"role": "assistant", "content": "", "tool_calls": [ADVANCE]}
    kw = {"tools": tools, "tokenize": True, "return_dict": False}
    prompt = tok.apply_chat_template(head, add_generation_prompt=True, **kw)
    ids = tok.apply_chat_template([*head, call], **kw)
    close = tok.convert_tokens_to_ids("<|im_end|>")
    return ids[len(prompt) : ids.index(close, len(prompt)) + 1]


class ScriptedPolicy:
    """A policy client (bench only): answers after exactly `latency` s with fixed ids."""

    def __init__(self, ids: list[int], latency: float):
        self.ids = ids
        self.logprobs = [-0.5] * len(ids)
        self.latency = latency

    async def sample(self, prompt_ids, params, *, policy=None, session=None) -> Completion:
        await anyio.sleep(self.latency)
        return Completion(
            ids=list(self.ids),
            logprobs=list(self.logprobs),
            finish_reason="stop",
            policy=policy if isinstance(policy, PolicyRef) else REF,
        )


# -- instrumentation ----------------------------------------------------------------------------


class Stages:
    """Exclusive CPU time per stage, per thread: a nested stage pauses the one around it."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = defaultdict(float)
        self._local = threading.local()
        self._undo: list[tuple[Any, str, Any]] = []

    def enter(self, name: str) -> None:
        local = self._local
        stack = getattr(local, "stack", None)
        if stack is None:
            stack = local.stack = []
        now = time.thread_time()
        if stack:
            self.cpu[stack[-1]] += now - local.mark
        stack.append(name)
        local.mark = now

    def exit(self) -> None:
        local = self._local
        now = time.thread_time()
        self.cpu[local.stack.pop()] += now - local.mark
        local.mark = now

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        """Time a sync method or an async one (CPU only while the coroutine runs)."""
        original = owner.__dict__[attr]
        func = original.__func__ if isinstance(original, classmethod) else original
        stages = self

        if _is_async(func):

            def timed(*args: Any, **kwargs: Any) -> _TimedAwait:
                return _TimedAwait(stages, name, func(*args, **kwargs))
        else:

            def timed(*args: Any, **kwargs: Any) -> Any:
                stages.enter(name)
                try:
                    return func(*args, **kwargs)
                finally:
                    stages.exit()

        setattr(owner, attr, classmethod(timed) if isinstance(original, classmethod) else timed)
        self._undo.append((owner, attr, original))

    def time_gc(self) -> None:
        """Count the cyclic garbage collector's passes as their own stage, not the caller's."""

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                self.enter("gc")
            else:
                self.exit()

        gc.callbacks.append(on_gc)
        self._undo.append((gc, "callbacks", on_gc))

    def restore(self) -> None:
        for owner, attr, original in reversed(self._undo):
            if owner is gc:
                gc.callbacks.remove(original)
            else:
                setattr(owner, attr, original)
        self._undo.clear()


def _is_async(func: Callable[..., Any]) -> bool:
    import inspect

    return inspect.iscoroutinefunction(func)


class _TimedAwait:
    """Drives a coroutine step by step, timing only the steps (not the waits between)."""

    __slots__ = ("coro", "name", "stages")

    def __init__(self, stages: Stages, name: str, coro: Any):
        self.stages, self.name, self.coro = stages, name, coro

    def __await__(self) -> Generator[Any, Any, Any]:
        value: Any = None
        error: BaseException | None = None
        while True:
            self.stages.enter(self.name)
            try:
                yielded = self.coro.send(value) if error is None else self.coro.throw(error)
            except StopIteration as stop:
                return stop.value
            finally:
                self.stages.exit()
            try:
                value, error = (yield yielded), None
            except BaseException as exc:  # delivered into the coroutine at its next step
                value, error = None, exc


class ThreadProfiles:
    """cProfile in every thread that runs a wrapped call, merged at the end."""

    def __init__(self) -> None:
        self.main = cProfile.Profile(time.thread_time)
        self._profiles: dict[int, cProfile.Profile] = {}
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attr: str) -> None:
        original = owner.__dict__[attr]
        profiles = self._profiles

        def profiled(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is threading.main_thread():
                return original(*args, **kwargs)
            prof = profiles.setdefault(threading.get_ident(), cProfile.Profile(time.thread_time))
            prof.enable()
            try:
                return original(*args, **kwargs)
            finally:
                prof.disable()

        setattr(owner, attr, profiled)
        self._undo.append((owner, attr, original))

    def restore(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)
        self._undo.clear()

    def stats(self) -> pstats.Stats:
        stats = pstats.Stats(self.main)
        for prof in self._profiles.values():
            stats.add(prof)
        return stats


def instrument(stages: Stages) -> None:
    stages.wrap(Conversation, "render", "render")
    stages.wrap(Conversation, "arender", "render")  # the incremental step runs inline here
    stages.wrap(Conversation, "_advance", "render")  # a fallback's render, in a worker thread
    stages.wrap(Conversation, "add_completion", "parse")
    stages.wrap(Conversation, "add_messages", "tool")
    stages.wrap(Env, "call_tool", "tool")
    stages.wrap(Turn, "from_completion", "record")
    stages.wrap(EpisodeContext, "add_turn", "record")
    stages.wrap(JsonlSink, "write", "sink")  # the scope's writer: each group's line ...
    stages.wrap(JsonlSink, "sync", "sink")  # ... and one fsync per batch, in a worker thread
    stages.wrap(ScriptedPolicy, "sample", "policy")
    stages.time_gc()


STAGES = ("render", "parse", "tool", "record", "sink", "policy", "gc")


# -- one measured run ---------------------------------------------------------------------------


@dataclass
class Row:
    window_turns: int
    window_s: float
    window_cpu_s: float
    worst_stall_s: float
    worst_stall_cpu_s: float
    """The worst stall counting only the loop thread's own CPU time (not time preempted)."""
    stage_cpu_s: dict[str, float] = field(default_factory=dict)
    fallbacks: int = 0
    later_turns: int = 0
    reuse: str = "-"
    """The renderer's memos over the whole run: incremental steps and parses reused."""


@dataclass(frozen=True)
class Setup:
    tok: Any
    ids: list[int]
    latency: float
    turns: int
    warmup: float | None
    window: float
    distinct: bool

    def warmup_for(self, concurrency: int) -> float:
        """Long enough for C episodes to start in one burst and reach their steady state."""
        return self.warmup if self.warmup is not None else 1.5 + concurrency / 512


async def measure(
    setup: Setup,
    path: str,
    concurrency: int,
    *,
    stages: Stages | None = None,
    profiles: ThreadProfiles | None = None,
) -> Row:
    """Keep `concurrency` episodes in flight for `warmup + window` s; measure the window."""
    policy = ScriptedPolicy(setup.ids, setup.latency)
    turns = setup.turns
    params = SamplingParams(max_tokens=32)

    async def make_env() -> CounterEnv:
        return CounterEnv(goal=turns, distinct=setup.distinct)

    with tempfile.TemporaryDirectory() as tmp:
        renderer = None
        if path == "bare":
            episode, pool = bare_episode(turns, params), EnvPool(nothing, limit=concurrency)
            sink_path, report = None, None
        else:
            renderer = ChatRenderer(setup.tok)
            harness = ToolCallingHarness(
                renderer,
                policy,
                params,
                limits=EpisodeLimits(max_turns=turns),
                system_prompt=SYSTEM,
            )
            episode = harness.play
            pool = EnvPool(make_env, limit=concurrency)
            sink_path, report = Path(tmp) / "groups.jsonl", Path(tmp) / "quarantine.json"
        sink = JsonlSink(sink_path).open() if sink_path is not None else None
        cpu: list[float] = []
        marks: list[int] = []
        stage_marks: list[dict[str, float]] = []
        stall = [0.0, 0.0]
        fallbacks = later = 0
        try:
            async with RolloutResources(sampler=policy, pools=[pool], report_path=report) as res:
                t0 = time.perf_counter()
                warmup = setup.warmup_for(concurrency)
                t_a, t_b = t0 + warmup, t0 + warmup + setup.window
                async with RolloutDriver(
                    res, episode, policy=REF, max_groups_in_flight=concurrency, sink=sink
                ) as d:

                    async def clock() -> None:
                        for t in (t_a, t_b):
                            await anyio.sleep(t - time.perf_counter())
                            if profiles is not None:
                                (profiles.main.enable if not cpu else profiles.main.disable)()
                            cpu.append(time.process_time())
                            marks.append(d.statistics().turns)
                            if stages is not None:
                                stage_marks.append(dict(stages.cpu))

                    async def probe() -> None:
                        while time.perf_counter() < t_b:
                            start, busy = time.perf_counter(), time.thread_time()
                            await anyio.sleep(STALL_PERIOD)
                            if start >= t_a:
                                late = time.perf_counter() - start - STALL_PERIOD
                                # The loop thread's own CPU bounds a stall: time the OS gave
                                # to other processes is not one.
                                late_cpu = min(late, time.thread_time() - busy)
                                stall[0] = max(stall[0], late)
                                stall[1] = max(stall[1], late_cpu)

                    def completed(group: Group) -> None:
                        nonlocal fallbacks, later
                        traj = check_completed(group, turns)
                        fallbacks += sum(t.fallback is not None for t in traj.turns[1:])
                        later += sum(t.extends for t in traj.turns[1:])

                    await drive_until(d, t_b, completed, clock, probe, spec=with_task)
                    done = d.statistics()
                assert done.leases.balanced and done.leases.released == done.settled_total
        finally:
            if sink is not None:
                sink.close()
    reuse = "-"
    if renderer is not None:
        memos = renderer.statistics()
        steps, parses = memos.deltas, memos.parses
        reuse = (
            f"{steps.hits / max(steps.hits + steps.misses, 1):.0%}/"
            f"{parses.hits / max(parses.hits + parses.misses, 1):.0%}"
        )
    stage_cpu = {}
    if stages is not None:
        stage_cpu = {k: stage_marks[1].get(k, 0.0) - stage_marks[0].get(k, 0.0) for k in STAGES}
    return Row(
        window_turns=marks[1] - marks[0],
        window_s=t_b - t_a,
        window_cpu_s=cpu[1] - cpu[0],
        worst_stall_s=stall[0],
        worst_stall_cpu_s=stall[1],
        stage_cpu_s=stage_cpu,
        fallbacks=fallbacks,
        later_turns=later,
        reuse=reuse,
    )


# -- main ---------------------------------------------------------------------------------------


def load_setup(args: argparse.Namespace) -> Setup:
    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    template = Path(trl.__file__).parent / "chat_templates" / f"{args.template}.jinja"
    tok.chat_template = template.read_text()
    schemas = [t.schema() for t in CounterEnv(1).tools()]
    return Setup(
        tok=tok,
        ids=scripted_completion(tok, schemas),
        latency=args.latency,
        turns=args.turns,
        warmup=args.warmup,
        window=args.window,
        distinct=args.distinct,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_load_arguments(
        parser,
        latency="policy",
        concurrency=[32, 256, 1024],
        turns=8,
        warmup=None,
        warmup_help="seconds before the window (default: 1.5 + C/512)",
    )
    parser.add_argument("--template", default="qwen3_training", help="a TRL template name")
    parser.add_argument(
        "--distinct",
        action="store_true",
        help="every tool result names its episode: no step, and no later parse, is ever reused",
    )
    parser.add_argument("--no-stages", action="store_true", help="skip the per-stage runs")
    parser.add_argument("--profile", type=Path, help="write merged cProfile stats here")
    parser.add_argument(
        "--python-gc",
        action="store_true",
        help="Python's own collector settings, as a loop outside plies.runtime.run has them "
        "(default: long_run_collector's, which run sets once the setup is loaded)",
    )
    args = parser.parse_args()

    setup = load_setup(args)
    with contextlib.nullcontext() if args.python_gc else long_run_collector():
        report(args, setup)


def report(args: argparse.Namespace, setup: Setup) -> None:
    """Measure each concurrency on both paths, then the harness path's stages."""
    frozen = ", loaded state frozen" if gc.get_freeze_count() else ""
    print(
        f"scripted in-process policy (bench only): L = {args.latency * 1000:g} ms, "
        f"{args.turns} turns/episode, template {args.template}"
        f"{', distinct tool results' if args.distinct else ''}; window {args.window:g} s after "
        f"the warm-up; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
        f"gc thresholds {gc.get_threshold()}{frozen}"
    )
    print("CPU/turn: process CPU time (all threads) over the window / turns in the window")
    print("worst stall: wall (and, in brackets, the loop thread's own CPU during it)")
    print("reused: incremental steps / parses the renderer's memos served (whole run)")
    header = (
        "path", "C", "ideal t/s", "achieved", "ratio", "CPU/turn", "worst stall", "incr.", "reused"
    )  # fmt: skip
    print("{:>7} {:>5} {:>10} {:>9} {:>7} {:>9} {:>18} {:>7} {:>9}".format(*header), flush=True)
    staged: list[tuple[int, Row]] = []
    for c in args.concurrency:
        for path in ("bare", "harness"):
            row = anyio.run(measure, setup, path, c)
            ideal = c / args.latency
            achieved, cpu_us = window_rates(row.window_turns, row.window_s, row.window_cpu_s)
            share = "-"
            if path == "harness":
                later = row.later_turns + row.fallbacks
                share = f"{row.later_turns / max(later, 1):.0%}"
            print(
                f"{path:>7} {c:>5} {ideal:>10.0f} {achieved:>9.0f} {achieved / ideal:>7.1%} "
                f"{cpu_us:>7.0f}us {row.worst_stall_s * 1000:>8.1f}ms "
                f"({row.worst_stall_cpu_s * 1000:>5.1f}ms) {share:>7} {row.reuse:>9}",
                flush=True,
            )
        if not args.no_stages:
            stages = Stages()
            profiles = ThreadProfiles() if args.profile else None
            instrument(stages)
            if profiles is not None:
                profiles.wrap(Conversation, "render")
                profiles.wrap(Conversation, "add_completion")
            try:
                run = partial(measure, stages=stages, profiles=profiles)
                staged.append((c, anyio.run(run, setup, "harness", c)))
            finally:
                if profiles is not None:
                    profiles.restore()
                stages.restore()
            if profiles is not None:
                stats = profiles.stats()
                stats.dump_stats(args.profile)
                stats.sort_stats("tottime").print_stats(25)
    if not staged:
        return
    print("\nharness CPU per turn by stage (instrumented runs; us/turn):")
    names = (*STAGES, "rest")
    print("{:>5} ".format("C") + " ".join(f"{n:>8}" for n in names) + f" {'total':>8}")
    for c, row in staged:
        n = max(row.window_turns, 1)
        split = dict(row.stage_cpu_s)
        split["rest"] = row.window_cpu_s - sum(split.values())
        cells = " ".join(f"{split[k] / n * 1e6:>8.0f}" for k in names)
        print(f"{c:>5} {cells} {row.window_cpu_s / n * 1e6:>8.0f}")
    print("gc: the cyclic garbage collector's passes, in whichever stage triggered them")
    print("rest: driver, pools, leases and their Settling blocks, anyio, thread hand-offs")


if __name__ == "__main__":
    main()
