"""`train`: GRPO on any env in one call, in a run directory that the same call resumes.

The run directory (docs/rl.md has the whole schema):

- `run.json`: `{"schema": 1, "kind": "grpo", "config": {...}}`, written once, atomically; a
  later call with other settings is refused rather than mixed into the same log;
- `metrics.jsonl`: the run log (`RunLog`), each step announced before it is sent and recorded
  with its policy once it is published;
- `groups.jsonl`: every completed group, fsynced before training sees it;
- `summary.json`: what the run did so far, rewritten from the log as each call ends (with
  held-out tasks: the evaluations before and after, and the paired improvement);
- `learning_curve.png`: the held-out evaluations by step (with held-out tasks), redrawn as
  each call ends;
- `retention.json`: the published policies kept and removed (with `keep_policies`);
- `quarantine.json`: envs the pool gave up on, if any.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console

from plies import ConfigError, PolicyRef
from plies._durable import write_atomic
from plies.environments import Env, Task
from plies.policy import TinkerPolicyClient, VLLMClient, publish
from plies.runtime import EnvPool, Interrupts, RolloutResources, read_jsonl
from plies.training import Trainer

from ._curve import plot_curve
from ._evaluate import evaluate
from ._grpo import Episode, GRPOConfig, Run, finished, grpo
from ._progress import RunProgress
from ._retention import retain
from ._runlog import RunLog
from ._session import run_session
from ._stats import ci95, paired_improvement

__all__ = [
    "RUN_SCHEMA",
    "claim_run_dir",
    "last_policy",
    "remove_run_dir",
    "summary",
    "train",
]

RUN_SCHEMA = 1
"""The version of the run directory's layout, recorded in `run.json` as `schema`."""


def claim_run_dir(out: Path, kind: str, settings: dict[str, Any]) -> bool:
    """Record a run of `kind` with `settings` in `out/run.json`, or check the one there.

    Returns:
        True when `out` already held this run (the caller resumes it).

    Raises:
        ConfigError: `out` is a file, its `run.json` does not read back, or holds another kind
            of run, another schema, or other settings (named, with their values).
    """
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file, not a run directory")
    out.mkdir(parents=True, exist_ok=True)
    run_file = out / "run.json"
    record = {"schema": RUN_SCHEMA, "kind": kind, "config": settings}
    if not run_file.exists():
        write_atomic(run_file, json.dumps(record).encode())
        return False
    try:
        saved = json.loads(run_file.read_text())
        saved_schema, saved_kind, saved_settings = saved["schema"], saved["kind"], saved["config"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(
            f"{run_file} is not a run record ({type(err).__name__}: {err}); "
            "remove it to start over, or choose another directory"
        ) from None
    if (saved_schema, saved_kind) != (RUN_SCHEMA, kind):
        raise ConfigError(
            f"{out} holds a {saved_kind!r} run of schema {saved_schema}, not a {kind!r} run of "
            f"schema {RUN_SCHEMA}; choose another directory"
        )
    if saved_settings != settings:
        names = sorted(settings.keys() | saved_settings.keys())
        differ = [n for n in names if settings.get(n) != saved_settings.get(n)]
        values = ", ".join(
            f"{n}={saved_settings.get(n)!r} then, {settings.get(n)!r} now" for n in differ
        )
        raise ConfigError(
            f"{out} holds a run made with other settings ({values}); resume it with the "
            "settings it was made with, or choose another directory"
        )
    return True


def remove_run_dir(out: Path | str) -> bool:
    """Delete the run in `out` to start over (a command's `--fresh`).

    Returns:
        True when there was a directory to remove.

    Raises:
        ConfigError: `out` is a file, or holds files but no `run.json`: not a run directory,
            so nothing is touched.
    """
    out = Path(out)
    if not out.exists():
        return False
    if not out.is_dir():
        raise ConfigError(f"{out} is a file, not a run directory; nothing was removed")
    if not (out / "run.json").is_file() and any(out.iterdir()):
        raise ConfigError(
            f"{out} holds files but no run.json: it is not a run directory, and nothing in it "
            "was removed"
        )
    shutil.rmtree(out)
    return True


def last_policy(out: Path | str, *, kinds: Sequence[str] = ("step",)) -> PolicyRef | None:
    """The policy the run in `out` continues from: that of its newest record of one of
    `kinds` (a step's, for `train`'s runs), or None before any.

    What a trainer that does not keep its weights between sessions is opened from when the
    run resumes (`TinkerTrainingClient(..., resume_from=last_policy(out))`). It only reads
    the run log: a line cut off by a crash is left for `train` to remove and report.
    """
    records = read_jsonl(Path(out) / "metrics.jsonl").records
    logged = [r for r in records if r.get("kind") in kinds]
    return PolicyRef.model_validate(logged[-1]["policy"]) if logged else None


async def train(
    out: Path | str,
    config: GRPOConfig,
    *,
    tasks: Callable[[int], Task],
    env: type[Env] | Callable[[], Awaitable[Env]],
    play: Episode,
    trainer: Trainer,
    sampler: VLLMClient | TinkerPolicyClient,
    policy: PolicyRef,
    interrupts: Interrupts,
    held_out: Sequence[Task] = (),
    eval_every: int = 0,
    eval_concurrency: int = 64,
    keep_policies: int | None = None,
    console: Console | None = None,
) -> PolicyRef:
    """Train `policy` with GRPO on `tasks`, in the run directory `out`; resume what is there.

    Call it again with the same arguments after a crash or Ctrl-C and it continues: a step
    cut off midway is replayed on its own groups with the same op ids, so the trainer applies
    it once; the groups completed but not trained on are trained first.

    Args:
        tasks: `tasks(i)` is the task of the `i`-th group sampled.
        env: an `Env` subclass (made with no arguments), or an async function making one.
        play: plays one episode (`ToolCallingHarness.play`, an agent harness's `play`).
        trainer: the training client; `sampler` samples on the same service.
        policy: where a new run starts (a resumed run starts from its last step's policy).
        interrupts: from `plies.runtime.run`, which gives Ctrl-C its three steps.
        held_out: tasks the policy is evaluated on before GRPO (`start`) and after it
            (`final`), each played once (`evaluate`, at most `eval_concurrency` at a time):
            the same tasks both times, so `summary.json` pairs them up task by task.
        eval_every: also evaluate on `held_out` after every this many steps (`curve`
            evaluations), for the learning curve; 0: before and after only.
        keep_policies: keep only this many of the newest published policies, besides
            `policy` and the versions groups in flight may sample from (`plies.rl.retain`:
            from a `plies serve` store on this disk, or through a trainer that deletes
            them, as on the Tinker API); None keeps every one. Not part of the run's
            settings: it changes what stays on disk, not what the run computes.

    Returns:
        The newest policy: the last step's (this call's or an earlier one's), or `policy`
        when no step trained.

    Raises:
        ConfigError: `out` holds another run (`claim_run_dir`) or a damaged log;
            `eval_every` is negative or set without `held_out`; `keep_policies` is below 1,
            or set where the policies can be neither found on disk nor deleted through
            `trainer`; or the run has logged steps
            and `trainer` holds fewer (it was not opened from the run's weights: a Tinker
            trainer resumes with `resume_from=last_policy(out)`).
    """
    out = Path(out)
    console = console or Console(stderr=True, soft_wrap=True)
    if not isinstance(eval_every, int) or eval_every < 0 or (eval_every and not held_out):
        raise ConfigError(
            f"eval_every is {eval_every!r}: an integer >= 0, and above 0 only with held_out tasks"
        )
    if keep_policies is not None and (not isinstance(keep_policies, int) or keep_policies < 1):
        raise ConfigError(
            f"keep_policies is {keep_policies!r}: at least 1 (the newest, which a resume "
            "needs), or None to keep every policy"
        )
    settings = asdict(config) | ({"held_out": [t.id for t in held_out]} if held_out else {})
    settings |= {"eval_every": eval_every} if eval_every else {}
    resuming = claim_run_dir(out, "grpo", settings)
    start = policy
    steps = [r for r in read_jsonl(out / "metrics.jsonl").records if r.get("kind") == "step"]
    if steps:  # checked before the log is opened: a refused call writes nothing
        policy = PolicyRef.model_validate(steps[-1]["policy"])
        held = (await trainer.state()).step
        if held < len(steps):
            raise ConfigError(
                f"the run in {out} took {len(steps)} GRPO steps, and the trainer holds "
                f"{held}: it does not hold the run's weights, and training it would mix "
                "them with another's; open it from the run's last policy "
                "(TinkerTrainingClient(..., resume_from=plies.rl.last_policy(out)))"
            )
    if resuming:
        console.print(f"[bold]resuming[/] the run in {out}")

    async def prune(newest: PolicyRef | None, *, sampling: bool) -> None:
        """Apply `keep_policies`; while sampling, groups in flight may still sample from the
        newest `max_staleness + 1` versions, so those stay too."""
        if keep_policies is None:
            return
        logged = [PolicyRef.model_validate(r["policy"]) for r in log.all("step")]
        _, failures = await retain(
            out, [start, *logged, *([newest] if newest else [])], trainer=trainer,
            warm=start.version, keep=keep_policies,
            max_staleness=config.max_staleness if sampling else None,
        )  # fmt: skip
        for why in failures:
            console.print(f"[yellow]retention[/]: {why}; it is tried again later")

    async def serve(new: PolicyRef) -> None:
        await publish(new, [sampler])
        await prune(new, sampling=True)

    async def curve(step: int, new: PolicyRef) -> None:
        if eval_every and step % eval_every == 0:
            await evaluate(
                run, new, held_out, label="curve", step=step, concurrency=eval_concurrency
            )

    limit = max(config.group_size * config.groups_in_flight, eval_concurrency * bool(held_out))
    with run_session(out, console, interrupts) as log:
        async with RolloutResources(
            sampler=sampler,
            pools=[EnvPool(_factory(env), limit=limit)],
            report_path=out / "quarantine.json",
        ) as resources:
            with RunProgress(console) as progress:
                run = Run(
                    out=out, log=log, trainer=trainer, sampler=sampler, resources=resources,
                    play=play, publish=serve, console=console, interrupts=interrupts,
                    progress=progress,
                )  # fmt: skip
                await serve(policy)  # idempotent; a restarted server needs it
                if held_out:
                    if start != policy and log.last("eval", label="start") is None:
                        await serve(start)  # cut off before its first evaluation was logged
                    await evaluate(
                        run, start, held_out, label="start", step=0, concurrency=eval_concurrency
                    )
                policy = await grpo(run, policy, config, tasks, after_step=curve)
                if held_out and finished(log, config):
                    await evaluate(
                        run, policy, held_out, label="final", step=len(log.all("step")),
                        concurrency=eval_concurrency,
                    )  # fmt: skip
                if finished(log, config):
                    await prune(None, sampling=False)
    steps = log.all("step")
    newest = PolicyRef.model_validate(steps[-1]["policy"]) if steps else policy
    write_atomic(out / "summary.json", json.dumps(summary(log, config, newest), indent=2).encode())
    evals = log.all("eval")
    if evals:
        plot_curve(evals, out / "learning_curve.png")
    return newest


def summary(log: RunLog, config: GRPOConfig, policy: PolicyRef) -> dict[str, Any]:
    """`summary.json`: what the run did so far, from its log (every session of it)."""
    steps = log.all("step")
    done = finished(log, config)
    evals = {e["label"]: e for e in log.all("eval")}
    held_out: dict[str, Any] = {}
    for label in ("start", "final"):
        record = evals.get(label)
        if record is not None:
            held_out[label] = {
                "return": record["return"], "ci95": ci95(record["return"], record["stderr"]),
                "episodes": record["episodes"], "failed": record["failed"],
            }  # fmt: skip
    if "start" in evals and "final" in evals:
        mean, stderr, paired = paired_improvement(
            evals["start"]["rewards"], evals["final"]["rewards"]
        )
        held_out["improvement"] = {"mean": mean, "ci95": ci95(mean, stderr), "paired": paired}
    return {
        "schema": RUN_SCHEMA,
        "kind": "grpo",
        "grpo_steps": len(steps),
        "complete": done,
        "stopped_early": done and len(steps) < config.steps,
        "policy": policy.model_dump(mode="json"),
        "minutes": sum(r["seconds"] for r in log.all("session")) / 60,
        "set_aside": dict(Counter(r["reason"] for r in log.all("set_aside"))),
        "train_return": [r["train_return"] for r in steps],
        "held_out": held_out or None,
    }


def _factory(env: type[Env] | Callable[[], Awaitable[Env]]) -> Callable[[], Awaitable[Env]]:
    """An async function making one env, from an `Env` subclass or such a function."""
    if not isinstance(env, type):
        return env
    env_class = env

    async def make() -> Env:
        return env_class()

    return make
