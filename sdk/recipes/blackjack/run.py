"""The job itself: open the servers, the clients and the pools, then run the phases in order.

Everything that matters lives in the run directory, so running the same command again
resumes: the warm start, each evaluation and each GRPO step is done once and logged, and a
resumed run reads the log back to continue from the last published policy.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

import anyio
from rich.console import Console

from plies import ConfigError, PolicyRef
from plies._durable import write_atomic
from plies.environments import (
    BlackjackEnv,
    E2BBackend,
    Env,
    LocalProcessBackend,
    OpenEnvEndpoint,
    OpenEnvEnv,
    SandboxBackend,
    SandboxedBlackjackEnv,
)
from plies.policy import SeededPolicy
from plies.rl import RUN_SCHEMA, RunLog, RunProgress, remove_run_dir, run_session
from plies.runtime import EnvPool, Interrupts, RolloutResources, run
from plies.testing import plies_command, serve_process, tiny_model_dir
from plies.tokens import ChatRenderer

from .config import (
    DEFAULT_KEEP_POLICIES,
    TEMPLATE_KWARGS,
    DemoConfig,
    EnvName,
    SamplerName,
    SandboxName,
    TrainerName,
    recorded_budget,
    recorded_config,
)
from .evaluation import evaluate
from .grpo import grpo
from .report import print_result, write_summary
from .rewards import harness_for_budget, sampling_for_budget
from .state import RunState
from .trainers import Serving, open_clients
from .warm_start import applied_steps, transcripts, warm_start

__all__ = ["main", "openenv_server", "policy_server"]

OPENENV_SESSIONS = 32
"""Concurrent sessions the OpenEnv server accepts (`--env openenv`)."""

EnvFactory = Callable[[], Awaitable[Env]]


QUIET_LIBRARIES = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}
"""Added to the server's environment: without them transformers draws a tqdm bar into
`server.log` each time a policy is saved or loaded, and repeats its advisories there."""


def policy_server(
    model_dir: Path, state_dir: Path, log: Path, *, batch_invariant: bool = False
) -> Serving:
    """`plies serve MODEL_DIR --state-dir STATE_DIR` on 127.0.0.1, in its own session."""
    argv = plies_command("serve", str(model_dir), "--state-dir", str(state_dir))
    argv += ["--max-batch-size", "64"] + ["--batch-invariant"] * batch_invariant
    return serve_process(argv, log=log, env={**os.environ, **QUIET_LIBRARIES})


def openenv_server(max_sessions: int, log: Path) -> Serving:
    """`python -m plies.environments.openenv_server` on 127.0.0.1, in its own session."""
    argv = [sys.executable, "-m", "plies.environments.openenv_server", "--port", "0"]
    return serve_process([*argv, "--max-sessions", str(max_sessions)], log=log)


def main(
    out: Path,
    *,
    budget: str = "default",
    env: EnvName = "local",
    sandbox: SandboxName = "none",
    trainer: TrainerName = "native",
    tinker_url: str | None = None,
    sampler: SamplerName = "batched",
    keep_policies: int | None = DEFAULT_KEEP_POLICIES,
    settings: Sequence[str] = (),
    seed: int = 0,
    fresh: bool = False,
) -> int:
    """Run (or resume) the job in `out`; return the exit code (130 after Ctrl-C).

    `trainer="tinker"` trains and samples through the Tinker API: on `tinker_url` (or
    `TINKER_BASE_URL`, with `TINKER_API_KEY`), else on the embedded server's (`trainers`).
    `sampler`: how the embedded server decodes (`config.SamplerName`).
    `keep_policies`: the newest GRPO policies kept on disk (None: all; `plies.rl.retain`).
    `settings`: `FIELD=VALUE`s changing the budget's numbers (`config.budget_with`).
    `seed`: which training deals and warm-start transcripts the run draws (`config.RUN_SEEDS`).
    `fresh`: remove the run already in `out` and start over.

    Raises:
        ConfigError: unknown or conflicting options, `out` is a file or holds a different
            run, or `--sandbox e2b` without `E2B_API_KEY`; all before any work.
    """
    config = DemoConfig(
        out=Path(out),
        budget=budget,
        env=env,
        sandbox=sandbox,
        trainer=trainer,
        tinker_url=tinker_url,
        sampler=sampler,
        keep_policies=keep_policies,
        settings=tuple(settings),
        seed=seed,
    )
    if config.sandbox == "e2b" and not os.environ.get("E2B_API_KEY"):
        # Without it the warm start would run and then every hand fail.
        raise ConfigError("--sandbox e2b needs E2B_API_KEY in the environment")
    console = Console(stderr=True, soft_wrap=True)
    if fresh and remove_run_dir(config.out):
        console.print(f"--fresh: removed the run in {config.out}")
    _claim_run_dir(config, console)  # a run dir that cannot resume: before any work
    return run(lambda interrupts: _job(config, interrupts))


def _claim_run_dir(config: DemoConfig, console: Console) -> None:
    """Record the run's options in `run.json`, or check that they match the run found there."""
    config.out.mkdir(parents=True, exist_ok=True)
    run_file = config.out / "run.json"
    budget = asdict(config.plan)
    if not run_file.exists():
        # Atomic: a crash mid-write must not leave a run.json that no resume can read.
        # What sampled the run's turns, as `plies replay` reads it.
        sampler = {"batch_invariant": config.sampler == "batch-invariant"}
        sampling = sampling_for_budget(config.plan).model_dump(mode="json")
        record = {
            "schema": RUN_SCHEMA,
            "kind": "blackjack",
            "config": config.key(),
            "budget": budget,
            "sampler": sampler,
            "sampling": sampling,
        }
        write_atomic(run_file, json.dumps(record).encode())
        return
    try:
        saved = json.loads(run_file.read_text())
        saved_config, saved_budget = recorded_config(saved), recorded_budget(saved["budget"])
    except ConfigError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(
            f"{run_file} is not a run record ({type(err).__name__}: {err}); "
            "remove it to start over, or choose another --out"
        ) from None
    key = config.key()
    if saved_config != key:
        differ = [k for k in key if saved_config.get(k) != key[k]]
        was = " ".join(f"--{k} {saved_config.get(k)}" for k in differ)
        now = " ".join(f"--{k} {key[k]}" for k in differ)
        other = f"{config.out}-{config.budget}" if "budget" in differ else f"{config.out}-2"
        raise ConfigError(
            f"{config.out} holds a run made with {was}, not {now}: resume it with {was}, "
            f"or run this one in another directory (--out {other}), or add --fresh to "
            "remove that run and start over"
        )
    if saved_budget != budget:
        # Same name, other numbers (another --set, or the budget table changed): the log
        # would not fit them.
        changed = sorted(
            k for k in budget.keys() | saved_budget.keys() if budget.get(k) != saved_budget.get(k)
        )
        values = ", ".join(f"{k}={saved_budget.get(k)} then, {budget.get(k)} now" for k in changed)
        raise ConfigError(
            f"{config.out} was run with other values of budget {config.budget!r} "
            f"({', '.join(changed)} differ: {values}); resume it with the --set values it was "
            "run with, run in another directory (--out), or add --fresh to remove that run "
            "and start over"
        )
    console.print(f"[bold]resuming[/] the run in {config.out}")


async def _job(config: DemoConfig, interrupts: Interrupts) -> None:
    console = Console(stderr=True, soft_wrap=True)  # a log keeps each line whole
    with run_session(config.out, console, interrupts) as log:
        await _open_and_run(config, log, console, interrupts)
    print_result(console, write_summary(config, log), config.out)


async def _open_and_run(
    config: DemoConfig, log: RunLog, console: Console, interrupts: Interrupts
) -> None:
    """Open the servers, clients and pools on one exit stack, then run the phases."""
    from transformers import AutoTokenizer  # heavy: loaded once the options are known good

    budget = config.plan
    out = config.out
    progress = RunProgress(console)
    model_dir = await anyio.to_thread.run_sync(tiny_model_dir)
    tokenizer = await anyio.to_thread.run_sync(AutoTokenizer.from_pretrained, model_dir)
    renderer = ChatRenderer(tokenizer, template_kwargs=dict(TEMPLATE_KWARGS))

    invariant = config.sampler == "batch-invariant"
    async with AsyncExitStack() as stack:
        stack.enter_context(progress)
        clients = await open_clients(
            config,
            stack,
            server=lambda: policy_server(
                model_dir, out / "server", out / "server.log", batch_invariant=invariant
            ),
            model_dir=model_dir,
            tokenizer=tokenizer,
            console=console,
        )
        trainer, client = clients.trainer, clients.sampler
        make_env = await _env_factory(config, stack)
        pool_limit = budget.eval_concurrency + budget.group_size * budget.groups_in_flight
        resources = await stack.enter_async_context(
            RolloutResources(
                sampler=client,
                pools=[EnvPool(make_env, limit=pool_limit)],
                report_path=out / "quarantine.json",
            )
        )
        # Seeded per episode and turn, so `plies replay` can re-sample any recorded turn.
        harness = harness_for_budget(renderer, SeededPolicy(client), budget)
        state = RunState(
            config=config,
            log=log,
            trainer=trainer,
            client=client,
            resources=resources,
            harness=harness,
            renderer=renderer,
            tokenizer=tokenizer,
            base=clients.base,
            console=console,
            interrupts=interrupts,
            progress=progress,
        )
        await _phases(state)


async def _env_factory(config: DemoConfig, stack: AsyncExitStack) -> EnvFactory:
    """How the pool makes one Blackjack env: in process, over OpenEnv, or in a sandbox."""
    if config.env == "openenv":
        log = config.out / "openenv.log"
        env_server = await stack.enter_async_context(openenv_server(OPENENV_SESSIONS, log))
        endpoint = OpenEnvEndpoint(env_server.url, max_sessions=OPENENV_SESSIONS)

        async def openenv() -> Env:
            return OpenEnvEnv(endpoint)

        return openenv
    if config.sandbox != "none":
        backend: SandboxBackend = (
            LocalProcessBackend(config.out / "sandboxes")
            if config.sandbox == "local"
            else E2BBackend()
        )
        run_id = config.out.name

        async def sandboxed() -> Env:
            return SandboxedBlackjackEnv(backend, run_id=run_id)

        return sandboxed

    async def local() -> Env:
        return BlackjackEnv()

    return local


async def _phases(run: RunState) -> None:
    """Warm start, evaluate, GRPO, evaluate again; each phase skipped when the log has it."""
    budget = run.budget
    warm = run.log.last("warm_start")
    if warm is None:
        warm = await _warm_start(run)
    policy = PolicyRef.model_validate(warm["policy"])
    await evaluate(run, policy, budget.eval_hands, "warm_start", 0)

    steps = run.log.all("step")
    if steps:
        policy = PolicyRef.model_validate(steps[-1]["policy"])
    await run.publish(policy)  # idempotent; a restarted server needs it
    await grpo(run, policy)
    final = run.log.all("step")
    policy = PolicyRef.model_validate(final[-1]["policy"]) if final else policy
    await evaluate(run, policy, budget.eval_hands, "final", len(final))
    await run.prune(sampling=False)


async def _warm_start(run: RunState) -> dict[str, Any]:
    """The supervised warm start, from the last step the trainer applied; its log record."""
    budget = run.budget
    t0 = time.monotonic()
    start = await applied_steps(run.trainer)
    if start:
        run.log.write("warm_resume", step=start)
        run.console.print(
            f"warm start: resuming at step {start} of {budget.warm_steps} "
            "(every step the trainer applied)"
        )
    else:
        run.console.print(
            f"warm start: {budget.warm_steps} supervised steps on transcripts of "
            f"{budget.warm_players} players"
        )
    data = await transcripts(
        run.renderer,
        run.tokenizer,
        budget.warm_hands,
        policy=run.base,
        players=budget.warm_players,
        seed=run.config.seed,
    )
    with run.progress.phase("warm start", budget.warm_steps, completed=start) as phase:

        def on_step(step: int, metrics: dict[str, float]) -> None:
            phase.advance(status=f"loss {metrics.get('loss', 0):.3f}")
            run.stop_if_interrupted()

        policy = await warm_start(run.trainer, data, budget, start=start, on_step=on_step)
    await run.publish(policy)
    return run.log.write("warm_start", policy=policy.model_dump(), seconds=time.monotonic() - t0)
