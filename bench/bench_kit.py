"""What the rollout benches share: their load arguments, the bare episode, the admission loop.

`runtime_bench.py`, `rollout_bench.py` and `shard_bench.py` all keep C episodes in flight
for a warm-up and a window and count the turns in the window; each imports this module from
its own folder (a bench runs as `python bench/<name>.py`). Only anyio and plies are
imported, and only inside the functions that need them, so that `runtime_bench.py --serve`
(a stand-in engine) starts without them.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from plies import Group, Trajectory
    from plies.policy import SamplingParams
    from plies.runtime import EpisodeContext, GroupSpec, RolloutDriver, ShardedDriver

T = TypeVar("T")


def add_load_arguments(
    parser: argparse.ArgumentParser,
    *,
    latency: str,
    concurrency: list[int],
    turns: int,
    warmup: float | None,
    warmup_help: str = "seconds before the window",
) -> None:
    """The load every rollout bench takes: latency L, values of C, turns, warm-up, window."""
    parser.add_argument("--latency", type=float, default=0.1, help=f"{latency} latency L, s")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=concurrency, help="values of C"
    )
    parser.add_argument("--turns", type=int, default=turns, help="turns per episode")
    parser.add_argument("--warmup", type=float, default=warmup, help=warmup_help)
    parser.add_argument("--window", type=float, default=4.0, help="seconds measured")


class Nothing:
    """The env resource: free to create, so the pool's bookkeeping is what is measured."""

    async def aclose(self) -> None:
        import anyio

        await anyio.lowlevel.checkpoint()


async def nothing() -> Nothing:
    """`EnvPool`'s factory of `Nothing`s."""
    return Nothing()


def add_collector_argument(parser: argparse.ArgumentParser) -> None:
    """`--collector`: the cyclic collector as `plies.runtime.run` sets it for a script's main
    (`long-run`, the default: the path a real run takes) or Python's own thresholds."""
    parser.add_argument(
        "--collector",
        choices=("long-run", "default"),
        default="long-run",
        help="the cyclic collector as plies.runtime.run sets it (long_run_collector), or "
        "Python's default thresholds",
    )


def add_loop_argument(parser: argparse.ArgumentParser) -> None:
    """`--loop`: asyncio's own event loop (the default: the one `plies.runtime.run` runs a
    script on) or uvloop, when it is installed (`pip install uvloop`), to compare."""
    parser.add_argument(
        "--loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="asyncio's own event loop (plies.runtime.run's), or uvloop where installed",
    )


def run_on(loop: str, func: Callable[..., Awaitable[T]], *args: object) -> T:
    """`anyio.run(func, *args)` on the `--loop` named."""
    import importlib.util

    import anyio

    if loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
        raise SystemExit("--loop uvloop: uvloop is not installed here (pip install uvloop)")
    return anyio.run(func, *args, backend_options={"use_uvloop": loop == "uvloop"})


def bare_episode(
    turns: int, params: SamplingParams, recorded: list[float] | None = None
) -> Callable[[EpisodeContext], Awaitable[Trajectory]]:
    """The runtime's own episode: borrow a lease, sample `turns` times inside
    `lease.operation("sample")`, record each turn (and, into `recorded`, when it was
    recorded). No renderer, parser, tool or sink."""
    from plies import Turn
    from plies.tokens import PromptDelta

    async def episode(ctx: EpisodeContext) -> Trajectory:
        prompt = [1, 2, 3, 4]
        async with ctx.borrow("env") as lease:
            for k in range(turns):
                async with lease.operation("sample"):
                    c = await ctx.sampler.sample(prompt, params, policy=ctx.policy)
                ctx.add_turn(Turn.from_completion(PromptDelta(prompt if k == 0 else [5], k > 0), c))
                if recorded is not None:
                    recorded.append(time.perf_counter())
        return ctx.trajectory

    return episode


async def drive_until(
    driver: RolloutDriver | ShardedDriver,
    until: float,
    on_group: Callable[[Group], object],
    *beside: Callable[[], Awaitable[None]],
    spec: Callable[[str], GroupSpec] | None = None,
) -> None:
    """Admit groups `t0`, `t1`, ... as fast as `driver` takes them until `until` (a
    `time.perf_counter()` moment), then close admission; hand each group to `on_group` as it
    comes, with the tasks `beside` (the bench's clock, a probe) running alongside."""
    import anyio

    from plies.runtime import GroupSpec

    make_spec = spec or GroupSpec

    async def admit() -> None:
        i = 0
        while time.perf_counter() < until:
            await driver.admit(make_spec(f"t{i}"))
            i += 1
        driver.close_admission()

    async with anyio.create_task_group() as tg:
        for task in (*beside, admit):
            tg.start_soon(task)
        async for group in driver.groups():
            on_group(group)


def with_task(group_id: str) -> GroupSpec:
    """A group whose task is an env `Task` of the same id, as the harness path wants."""
    from plies.environments import Task
    from plies.runtime import GroupSpec

    return GroupSpec(group_id, task=Task(id=group_id))


def check_completed(group: Group, turns: int) -> Trajectory:
    """The group's one trajectory, checked as every harness-path row checks it: completed,
    with all its `turns`."""
    traj = group.trajectories[0]
    assert traj.status.value == "completed", traj.error
    assert len(traj.turns) == turns, len(traj.turns)
    return traj


def window_rates(turns: int, seconds: float, cpu_s: float) -> tuple[float, float]:
    """Turns/s over a window of `seconds` and CPU microseconds per turn (`cpu_s` over it)."""
    return turns / seconds, cpu_s / max(turns, 1) * 1e6
