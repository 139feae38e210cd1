"""The main job: Blackjack GRPO on the tiny Qwen3 model, start to finish on a laptop CPU.

`plies demo blackjack --out DIR` (and `examples/blackjack_grpo.py`, a thin wrapper) runs:

1. the offline kit: the Qwen3 tokenizer and the tiny random Qwen3 model;
2. the reference server (`plies serve`) on 127.0.0.1, in its own process group so that
   Ctrl-C reaches only this script, which decides what to stop;
3. a supervised warm start (`cross_entropy` through the `TrainingClient`) on generated
   transcripts whose hit/stand choices are uniformly random: the model learns to emit
   well-formed tool calls and nothing about strategy, which is left to RL;
4. GRPO: each group is G episodes of one seeded deal (rewards differ only by the actions),
   advantages are each reward minus the group mean, `training_groups` checks every group,
   then `forward_backward` (importance sampling) + `optim_step` + `save_policy` + publish;
   new groups are admitted under the new policy while the `RolloutDriver`'s bound on
   groups in flight keeps sampling at most a step or two ahead (staleness by pacing);
5. evaluation on held-out deals (the same seeds before and after, so the comparison is
   paired), metrics in `DIR/metrics.jsonl`, `DIR/summary.json`, `DIR/learning_curve.png`.

Resuming: everything that matters is in DIR. Completed groups are fsynced to
`groups.jsonl` before training sees them; each step is announced in `metrics.jsonl`
(`step_begin`, with its groups) before it is sent, and its op ids are derived from the step
number, so a step cut off midway is replayed with the same ids and the trainer answers what
it already applied (or says the gradients are gone, and they are recomputed). Running the
same command again continues from the last published policy, and groups that completed
but were not trained on yet are trained first.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import anyio
from anyio.abc import Process

from . import models
from ._exceptions import AdmissionClosed, ConfigError, PliesError, TrainingGradientsLost
from .trajectory import Group, PolicyRef, Status, Trajectory, Turn

__all__ = [
    "BUDGETS",
    "SYSTEM_PROMPT",
    "Budget",
    "DemoConfig",
    "ServerInfo",
    "main",
    "openenv_server",
    "policy_server",
    "tool_call_ids",
    "transcripts",
    "warm_start",
]

SYSTEM_PROMPT = "You play Blackjack. Reply with exactly one tool call: hit or stand."
"""Terse on purpose: every token of the prompt is paid for at each turn."""

TEMPLATE_KWARGS = MappingProxyType({"enable_thinking": False})
"""Qwen3 without thinking: a completion is just `<tool_call>...</tool_call><|im_end|>`."""

RANDOM_RETURN = -0.396
ALWAYS_STAND_RETURN = -0.185
OPTIMAL_RETURN = -0.047
"""Exact expected returns per hand under these rules (see docs/environments.md)."""

TRAIN_SEEDS = 0
EVAL_SEEDS = 1_000_000_000
WARM_SEEDS = 2_000_000_000
"""Disjoint seed ranges: training deals, held-out evaluation deals, warm-start transcripts."""


@dataclass(frozen=True, slots=True)
class Budget:
    """How much work a run does. `BUDGETS` names the presets the command line offers."""

    warm_hands: int
    """Transcripts generated for the warm start (reused across its steps)."""
    warm_steps: int
    warm_batch: int
    """Hands per warm-start step."""
    warm_lr: float
    grpo_steps: int
    groups_per_step: int
    group_size: int
    lr: float
    eval_hands: int
    """Held-out hands evaluated before and after GRPO (the headline comparison)."""
    curve_every: int
    """Evaluate on `curve_hands` every this many steps, for the learning curve (0: never)."""
    curve_hands: int
    eval_concurrency: int = 64
    max_turns: int = 10
    max_new_tokens: int = 32


BUDGETS: MappingProxyType[str, Budget] = MappingProxyType(
    {
        "default": Budget(
            warm_hands=512, warm_steps=120, warm_batch=8, warm_lr=3e-2,
            grpo_steps=30, groups_per_step=8, group_size=8, lr=1e-2,
            eval_hands=2000, curve_every=10, curve_hands=400,
        ),
        "quick": Budget(
            warm_hands=512, warm_steps=120, warm_batch=8, warm_lr=3e-2,
            grpo_steps=10, groups_per_step=8, group_size=8, lr=1e-2,
            eval_hands=500, curve_every=5, curve_hands=200,
        ),
        "smoke": Budget(
            warm_hands=256, warm_steps=100, warm_batch=8, warm_lr=3e-2,
            grpo_steps=3, groups_per_step=2, group_size=4, lr=1e-2,
            eval_hands=32, curve_every=2, curve_hands=16, eval_concurrency=16,
        ),
    }
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """One run: where it lives, its budget, and which Blackjack it plays."""

    out: Path
    budget: str = "default"
    env: Literal["local", "openenv"] = "local"
    sandbox: Literal["none", "local", "e2b"] = "none"

    def __post_init__(self) -> None:
        if self.budget not in BUDGETS:
            raise ConfigError(f"unknown budget {self.budget!r}; known: {', '.join(BUDGETS)}")
        if self.env == "openenv" and self.sandbox != "none":
            raise ConfigError("--env openenv and --sandbox are alternatives; pick one")

    def key(self) -> dict[str, Any]:
        """What must match for a run directory to be resumed."""
        return {"budget": self.budget, "env": self.env, "sandbox": self.sandbox}


# -- servers ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """A started server, as its ready line described it."""

    url: str
    ready: dict[str, Any]


@asynccontextmanager
async def _subprocess_server(
    argv: Sequence[str], log: Path, *, ready_timeout: float = 300.0
) -> AsyncIterator[ServerInfo]:
    """Run a server that prints one JSON ready line; terminate (then kill) it on exit.

    It gets its own session, so a terminal's Ctrl-C reaches only this process, which then
    follows the runtime's three-step semantics instead of losing its server at once.
    """
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("ab") as err:
        process: Process = await anyio.open_process(
            list(argv), stdout=subprocess.PIPE, stderr=err, env=env, start_new_session=True
        )
    try:
        line = b""
        with anyio.fail_after(ready_timeout):
            assert process.stdout is not None
            while b"\n" not in line:
                chunk = await process.stdout.receive()
                line += chunk
        ready = json.loads(line.split(b"\n", 1)[0])
        yield ServerInfo(url=ready["url"], ready=ready)
    except (anyio.EndOfStream, TimeoutError) as exc:
        tail = log.read_text(errors="replace")[-2000:]
        raise PliesError(f"{argv[0]} {' '.join(argv[1:4])} did not start:\n{tail}") from exc
    finally:
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                process.terminate()
                with anyio.move_on_after(20):
                    await process.wait()
                if process.returncode is None:
                    process.kill()
                    await process.wait()
            await process.aclose()


def policy_server(model_dir: Path, state_dir: Path, log: Path) -> Any:
    """`plies serve MODEL_DIR --state-dir STATE_DIR` on 127.0.0.1 (an async context manager)."""
    argv = [sys.executable, "-c", "from plies.cli import app; app()", "serve", str(model_dir)]
    argv += ["--state-dir", str(state_dir), "--max-batch-size", "64"]
    return _subprocess_server(argv, log)


def openenv_server(max_sessions: int, log: Path) -> Any:
    """`python -m plies.environments.openenv_server` on 127.0.0.1 (an async context manager)."""
    argv = [sys.executable, "-m", "plies.environments.openenv_server", "--port", "0"]
    argv += ["--max-sessions", str(max_sessions)]
    return _subprocess_server(argv, log)


# -- warm start ---------------------------------------------------------------------------


def tool_call_ids(tokenizer: Any, name: str) -> list[int]:
    """The ids of a bare Qwen3 call of tool `name` with no arguments, close token included."""
    text = f'<tool_call>\n{{"name": "{name}", "arguments": {{}}}}\n</tool_call>'
    return [*tokenizer.encode(text), tokenizer.convert_tokens_to_ids("<|im_end|>")]


async def transcripts(
    renderer: Any, tokenizer: Any, hands: int, *, policy: PolicyRef, seed: int = 0
) -> list[Trajectory]:
    """Hands played with uniformly random hit/stand, rendered exactly as the harness would.

    The choices are random so that the warm start teaches the format, not a strategy.
    Completions are the canonical tool-call ids; logprobs are 0 (the loss ignores them).
    """
    from plies.environments import BlackjackEnv, Task

    rng = random.Random(seed)
    calls = {name: tool_call_ids(tokenizer, name) for name in ("hit", "stand")}
    out = []
    for i in range(hands):
        task = Task(id=f"warm-{i}", seed=WARM_SEEDS + i)
        async with BlackjackEnv() as env:
            obs = await env.reset(task)
            opening = [{"role": "system", "content": SYSTEM_PROMPT}, *obs.messages]
            conv = renderer.start(opening, tools=obs.tools)
            traj = Trajectory(task_id=task.id)
            done = False
            while not done:
                conv.render()
                delta = conv.delta
                name = rng.choice(("hit", "stand"))
                ids = calls[name]
                call = {"type": "function", "function": {"name": name, "arguments": {}}}
                conv.add_completion(
                    ids, "stop", message={"role": "assistant", "content": "", "tool_calls": [call]}
                )
                traj.turns.append(
                    Turn(
                        prompt_ids=delta.ids,
                        extends=delta.extends,
                        completion_ids=ids,
                        logprobs=[0.0] * len(ids),
                        finish_reason="stop",
                        policy=policy,
                    )
                )
                result = await env.call_tool(name, {})
                conv.add_messages([{"role": "tool", "name": name, "content": result.content}])
                done = result.done
            out.append(traj)
    return out


async def _train_step(
    trainer: Any,
    prefix: str,
    batch: Any,
    *,
    loss: str,
    lr: float,
) -> tuple[dict[str, float], dict[str, float]]:
    """forward_backward + optim_step with op ids derived from `prefix`, exactly once.

    Re-running a step after a crash sends the same ids: the trainer answers what it already
    applied. When it reports the gradients lost (it restarted between the two calls), the
    forward_backward is redone under a new id and the step is taken once.
    """
    from plies.training import AdamParams

    for attempt in range(3):
        tag = prefix if attempt == 0 else f"{prefix}-redo{attempt}"
        try:
            fb = await trainer.forward_backward(batch, loss=loss, op_id=f"{tag}-fb")
            opt = await trainer.optim_step(AdamParams(lr=lr, grad_clip=1.0), op_id=f"{prefix}-opt")
        except TrainingGradientsLost:
            continue
        return fb.metrics, opt.metrics
    raise PliesError(f"step {prefix}: the trainer lost its gradients three times")


async def warm_start(
    trainer: Any,
    data: Sequence[Trajectory],
    budget: Budget,
    *,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> PolicyRef:
    """Supervised steps (`cross_entropy`) over `data`, then `save_policy`. Replay-safe."""
    from plies.training import Datum, TrainingBatch

    for step in range(budget.warm_steps):
        first = (step * budget.warm_batch) % len(data)
        hands = [data[(first + j) % len(data)] for j in range(budget.warm_batch)]
        batch = TrainingBatch(
            data=[Datum.from_segment(seg, 1.0) for t in hands for seg in t.segments()]
        )
        fb, _ = await _train_step(
            trainer, f"warm-{step}", batch, loss="cross_entropy", lr=budget.warm_lr
        )
        if on_step is not None:
            on_step(step, fb)
    return await trainer.save_policy(op_id="warm-save")


# -- the run directory ----------------------------------------------------------------------


class RunLog:
    """`metrics.jsonl`: append-only and fsynced; what a resumed run reads back."""

    def __init__(self, path: Path):
        from plies.runtime import JsonlSink

        self.path = path
        self.records: list[dict[str, Any]] = []
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    self.records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a torn last line: the event it described did not complete
        self._sink = JsonlSink(path).open()

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        record = {"kind": kind, "time": time.time(), **fields}
        self._sink.write(record, sync=True)
        self.records.append(record)
        return record

    def close(self) -> None:
        self._sink.close()

    def last(self, kind: str, **match: Any) -> dict[str, Any] | None:
        for r in reversed(self.records):
            if r["kind"] == kind and all(r.get(k) == v for k, v in match.items()):
                return r
        return None

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["kind"] == kind]


# -- evaluation -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EvalResult:
    mean_return: float
    hands: int
    ill_formed: int
    failed: int
    stand_rate: float


async def _evaluate(
    resources: Any,
    harness: Any,
    policy: PolicyRef,
    hands: int,
    concurrency: int,
    interrupts: Any,
) -> EvalResult:
    """Play `hands` held-out deals under `policy`; ill-formed hands count as lost (-1)."""
    from plies.environments import Task
    from plies.runtime import GroupSpec, RolloutDriver

    rewards: list[float] = []
    ill = failed = stands = decisions = 0
    async with RolloutDriver(
        resources, harness.play, policy=policy, max_groups_in_flight=concurrency
    ) as driver:
        interrupts.attach(driver)

        async def admit() -> None:
            for i in range(hands):
                spec = GroupSpec(
                    task_id=f"eval-{i}", size=1, task=Task(id=f"eval-{i}", seed=EVAL_SEEDS + i)
                )
                try:
                    await driver.admit(spec)
                except AdmissionClosed:
                    return
            driver.close_admission()

        async with anyio.create_task_group() as tg:
            tg.start_soon(admit)
            async for group in driver.groups():
                traj = group.trajectories[0]
                if traj.reward is None:  # an error of the system, not a move of the model
                    failed += 1
                    continue
                rewards.append(traj.reward)
                ill += traj.info.get("stop_reason") == "ill_formed"
                for turn in traj.turns:
                    calls = (turn.message or {}).get("tool_calls") or []
                    decisions += len(calls)
                    stands += sum(c["function"]["name"] == "stand" for c in calls)
    if interrupts.count:
        raise _Interrupted
    mean = sum(rewards) / len(rewards) if rewards else float("nan")
    return EvalResult(mean, len(rewards), ill, failed, stands / decisions if decisions else 0.0)


FORFEIT = -1.0
"""The reward of a hand the model did not finish (ill-formed call, or out of tokens or turns):
scored as a loss, so evaluation counts it and GRPO learns to avoid it."""


class _Forfeiting:
    """The harness's episode, with a hand the model left unfinished scored as `FORFEIT`.

    Reward selection stays in the script: the harness reports how an episode ended, the demo
    decides what that is worth.
    """

    def __init__(self, harness: Any):
        self.harness = harness

    async def play(self, ctx: Any) -> Trajectory:
        traj = await self.harness.play(ctx)
        if traj.status is Status.TRUNCATED and traj.reward is None:
            traj.reward = FORFEIT
        return traj


class _Interrupted(Exception):
    """Internal: Ctrl-C arrived; the run stops after what it was doing settled."""


# -- GRPO -----------------------------------------------------------------------------------


def _group_index(group_id: str) -> int:
    return int(group_id.removeprefix("train-"))


async def _train_on(
    trainer: Any, step: int, groups: list[Group], policy: PolicyRef, budget: Budget
) -> tuple[PolicyRef | None, dict[str, Any]]:
    """One GRPO step on `groups`: check, advantages, importance sampling, save."""
    from plies.training import grpo_advantages, training_batch, training_groups

    selection = training_groups(groups, policy=policy, max_staleness=2)
    refused = [f"{r.group_id}: {r.reason.value}" for r in selection.refused]
    rewards = [t.reward for g in selection.trainable for t in g.trajectories]
    info: dict[str, Any] = {
        "groups": [g.id for g in groups],
        "trainable": len(selection.trainable),
        "refused": refused,
        "train_return": sum(rewards) / len(rewards) if rewards else None,
    }
    advantages = [grpo_advantages([t.reward for t in g.trajectories]) for g in selection.trainable]
    if not any(a for adv in advantages for a in adv):
        return None, info  # nothing to learn from: every group tied
    batch = training_batch(selection.trainable, advantages, temperature=1.0, skip_zero=True)
    fb, opt = await _train_step(
        trainer, f"grpo-{step}", batch, loss="importance_sampling", lr=budget.lr
    )
    info.update(loss=fb.get("loss"), grad_norm=opt.get("grad_norm"), tokens=fb.get("tokens"))
    new = await trainer.save_policy(op_id=f"grpo-{step}-save")
    return new, info


# -- the job --------------------------------------------------------------------------------


def main(
    out: Path,
    *,
    budget: str = "default",
    env: Literal["local", "openenv"] = "local",
    sandbox: Literal["none", "local", "e2b"] = "none",
) -> int:
    """Run (or resume) the demo in `out`; return the exit code (130 after Ctrl-C)."""
    from plies.runtime import run

    config = DemoConfig(out=Path(out), budget=budget, env=env, sandbox=sandbox)
    return run(lambda interrupts: _demo(config, interrupts))


async def _demo(config: DemoConfig, interrupts: Any) -> None:
    from rich.console import Console
    from transformers import AutoTokenizer

    from plies.harness import EpisodeLimits, ToolCallingHarness
    from plies.policy import SamplingParams, VLLMClient
    from plies.runtime import EnvPool, RolloutResources
    from plies.tokens import ChatRenderer
    from plies.training import TrainingClient

    console = Console(stderr=True)
    budget = BUDGETS[config.budget]
    out = config.out
    out.mkdir(parents=True, exist_ok=True)
    run_file = out / "run.json"
    if run_file.exists():
        saved = json.loads(run_file.read_text())
        if saved["config"] != config.key():
            raise ConfigError(
                f"{out} holds a run with {saved['config']}; resume it with the same options "
                "or choose another --out"
            )
        console.print(f"[bold]resuming[/] the run in {out}")
    else:
        run_file.write_text(json.dumps({"config": config.key(), "budget": asdict(budget)}))
    started = time.monotonic()
    log = RunLog(out / "metrics.jsonl")
    elapsed_before = sum(r.get("seconds", 0.0) for r in log.all("session"))

    model_dir = await anyio.to_thread.run_sync(models.tiny_model_dir)
    tokenizer = await anyio.to_thread.run_sync(AutoTokenizer.from_pretrained, model_dir)
    renderer = ChatRenderer(tokenizer, template_kwargs=dict(TEMPLATE_KWARGS))

    async with AsyncExitStack() as stack:
        stack.callback(log.close)
        server = await stack.enter_async_context(
            policy_server(model_dir, out / "server", out / "server.log")
        )
        console.print(f"reference server at {server.url}")
        trainer = await stack.enter_async_context(TrainingClient(server.url))
        client = await stack.enter_async_context(VLLMClient(server.url, server.ready["model"]))
        make_env = await _env_factory(config, stack, out)
        pool_limit = budget.eval_concurrency + budget.group_size * budget.groups_per_step * 2
        resources = await stack.enter_async_context(
            RolloutResources(
                policy=client,
                pools=[EnvPool(make_env, limit=pool_limit)],
                report_path=out / "quarantine.json",
            )
        )
        harness = _Forfeiting(
            ToolCallingHarness(
                renderer,
                client,
                SamplingParams(max_tokens=budget.max_new_tokens, temperature=1.0),
                limits=EpisodeLimits(max_turns=budget.max_turns),
                system_prompt=SYSTEM_PROMPT,
                ill_formed_reward=FORFEIT,
            )
        )
        base = PolicyRef.model_validate(server.ready["policy"])
        try:
            await _phases(config, budget, log, trainer, client, server, resources, harness,
                          base, renderer, tokenizer, console, interrupts)  # fmt: skip
        except _Interrupted:
            console.print("[yellow]interrupted[/]: run the same command again to resume")
        finally:
            log.write("session", seconds=time.monotonic() - started)
    total = elapsed_before + time.monotonic() - started
    _write_summary(config, log, total)


async def _env_factory(config: DemoConfig, stack: AsyncExitStack, out: Path) -> Any:
    from plies.environments import (
        BlackjackEnv,
        E2BBackend,
        LocalProcessBackend,
        OpenEnvEndpoint,
        OpenEnvEnv,
        SandboxedBlackjackEnv,
    )

    if config.env == "openenv":
        sessions = 32
        env_server = await stack.enter_async_context(openenv_server(sessions, out / "openenv.log"))
        endpoint = OpenEnvEndpoint(env_server.url, max_sessions=sessions)

        async def openenv() -> Any:
            return OpenEnvEnv(endpoint)

        return openenv
    if config.sandbox != "none":
        backend: Any = (
            LocalProcessBackend(out / "sandboxes") if config.sandbox == "local" else E2BBackend()
        )
        run_id = out.name

        async def sandboxed() -> Any:
            return SandboxedBlackjackEnv(backend, run_id=run_id)

        return sandboxed

    async def local() -> Any:
        return BlackjackEnv()

    return local


async def _phases(
    config: DemoConfig,
    budget: Budget,
    log: RunLog,
    trainer: Any,
    client: Any,
    server: ServerInfo,
    resources: Any,
    harness: Any,
    base: PolicyRef,
    renderer: Any,
    tokenizer: Any,
    console: Any,
    interrupts: Any,
) -> None:
    async def evaluate(policy: PolicyRef, hands: int, label: str, step: int) -> dict[str, Any]:
        done = log.last("eval", label=label, step=step)
        if done is not None:
            return done
        t0 = time.monotonic()
        result = await _evaluate(
            resources, harness, policy, hands, budget.eval_concurrency, interrupts
        )
        record = log.write(
            "eval", label=label, step=step, policy=policy.version, seconds=time.monotonic() - t0,
            **{"return": result.mean_return}, hands=result.hands, ill_formed=result.ill_formed,
            failed=result.failed, stand_rate=result.stand_rate,
        )  # fmt: skip
        console.print(
            f"eval [{label}] step {step}: return {result.mean_return:+.3f} over {result.hands} "
            f"hands (ill-formed {result.ill_formed}, stand rate {result.stand_rate:.2f}, "
            f"{record['seconds']:.0f}s)"
        )
        return record

    # 1. warm start
    warm = log.last("warm_start")
    if warm is None:
        t0 = time.monotonic()
        console.print(
            f"warm start: {budget.warm_steps} supervised steps on random-play transcripts"
        )
        data = await transcripts(renderer, tokenizer, budget.warm_hands, policy=base)

        def on_step(step: int, metrics: dict[str, float]) -> None:
            if step % 10 == 0 or step == budget.warm_steps - 1:
                console.print(f"  warm-start step {step}: loss {metrics.get('loss', 0):.3f}")
            if interrupts.count:
                raise _Interrupted

        policy = await warm_start(trainer, data, budget, on_step=on_step)
        await trainer.publish(policy, [server.url])
        warm = log.write("warm_start", policy=policy.model_dump(), seconds=time.monotonic() - t0)
    policy = PolicyRef.model_validate(warm["policy"])
    await evaluate(policy, budget.eval_hands, "warm_start", 0)

    # 2. GRPO
    steps = log.all("step")
    if steps:
        policy = PolicyRef.model_validate(steps[-1]["policy"])
    await trainer.publish(policy, [server.url])  # idempotent; a restarted server needs it
    await _grpo(budget, log, trainer, server, resources, harness, policy, console, interrupts,
                evaluate)  # fmt: skip
    final = log.all("step")
    policy = PolicyRef.model_validate(final[-1]["policy"]) if final else policy
    await evaluate(policy, budget.eval_hands, "final", len(final))


async def _grpo(
    budget: Budget,
    log: RunLog,
    trainer: Any,
    server: ServerInfo,
    resources: Any,
    harness: Any,
    policy: PolicyRef,
    console: Any,
    interrupts: Any,
    evaluate: Callable[..., Any],
) -> None:
    from plies.environments import Task
    from plies.runtime import GroupSpec, JsonlSink, LiveProgress, RolloutDriver, read_groups

    out = log.path.parent
    done_steps = log.all("step")
    step = len(done_steps)
    if step >= budget.grpo_steps:
        return
    trained = {g for r in log.all("step") for g in r["groups"]}
    on_disk = read_groups(out / "groups.jsonl").records
    waiting = [g for g in on_disk if g.id not in trained]
    begun = log.last("step_begin", step=step)
    if begun is not None:  # a step was cut off: replay it on the same groups, same op ids
        chosen = set(begun["groups"])
        waiting = [g for g in waiting if g.id in chosen] + [
            g for g in waiting if g.id not in chosen
        ]
    next_index = max((_group_index(g.id) for g in on_disk), default=-1) + 1
    if waiting:
        console.print(f"resuming at step {step} with {len(waiting)} completed untrained groups")
    served = {policy.version}

    with JsonlSink(out / "groups.jsonl") as sink:
        async with RolloutDriver(
            resources, harness.play, policy=policy,
            max_groups_in_flight=2 * budget.groups_per_step, sink=sink,
        ) as driver, LiveProgress(driver):  # fmt: skip
            interrupts.attach(driver)

            async def admit() -> None:
                index = next_index
                while True:
                    spec = GroupSpec(
                        task_id=f"train-{index}",
                        size=budget.group_size,
                        task=Task(id=f"train-{index}", seed=TRAIN_SEEDS + index),
                        id=f"train-{index}",
                    )
                    try:
                        await driver.admit(spec)
                    except AdmissionClosed:
                        return
                    index += 1

            async def consume() -> None:
                nonlocal step, policy, waiting
                async for group in driver.groups():
                    if interrupts.count or step >= budget.grpo_steps:
                        continue  # drained groups are on disk; a resumed run trains them
                    waiting.append(group)
                    if len(waiting) < budget.groups_per_step:
                        continue
                    batch, waiting = (
                        waiting[: budget.groups_per_step],
                        waiting[budget.groups_per_step :],
                    )
                    log.write("step_begin", step=step, groups=[g.id for g in batch])
                    t0 = time.monotonic()
                    new, info = await _train_on(trainer, step, batch, policy, budget)
                    if new is not None:
                        await trainer.publish(new, [server.url])
                        driver.set_policy(new)
                        policy = new
                        served.add(new.version)
                    log.write(
                        "step", step=step, policy=policy.model_dump(),
                        seconds=time.monotonic() - t0, **info,
                    )  # fmt: skip
                    ret = info["train_return"]
                    console.print(
                        f"step {step}: policy v{policy.version}, train return "
                        f"{ret if ret is None else round(ret, 3)}, refused {len(info['refused'])}"
                    )
                    step += 1
                    await _unload_unused(resources.policy, served, policy)
                    if (
                        budget.curve_every
                        and step % budget.curve_every == 0
                        and (step < budget.grpo_steps)
                    ):
                        await evaluate(policy, budget.curve_hands, "curve", step)
                    if step >= budget.grpo_steps:
                        driver.cancel()  # groups still sampling are not needed

            async with anyio.create_task_group() as tg:
                tg.start_soon(admit)
                await consume()
    if interrupts.count:
        raise _Interrupted


async def _unload_unused(client: Any, served: set[int], policy: PolicyRef) -> None:
    """Stop serving versions no admitted group can still sample from (memory stays flat).

    Groups in flight are at most two steps behind the newest policy: the driver admits at
    most two steps' worth of groups ahead of training.
    """
    from plies.policy import unload_lora_adapter

    for version in sorted(v for v in served if v < policy.version - 2):
        await unload_lora_adapter(client, f"policy-{version}")
        served.discard(version)


# -- outputs ----------------------------------------------------------------------------------


def _write_summary(config: DemoConfig, log: RunLog, minutes_s: float) -> None:
    out = config.out
    evals = log.all("eval")
    warm = next((e for e in evals if e["label"] == "warm_start"), None)
    final = next((e for e in evals if e["label"] == "final"), None)
    steps = log.all("step")
    warm_start = log.last("warm_start")
    summary = {
        "config": config.key(),
        "warm_start_return": warm["return"] if warm else None,
        "final_return": final["return"] if final else None,
        "improvement": (final["return"] - warm["return"]) if warm and final else None,
        "eval_hands": final["hands"] if final else (warm["hands"] if warm else 0),
        "ill_formed": {
            "warm_start": warm["ill_formed"] if warm else None,
            "final": final["ill_formed"] if final else None,
        },
        "minutes": round(minutes_s / 60, 2),
        "policies": len(
            {s["policy"]["version"] for s in steps}
            | ({warm_start["policy"]["version"]} if warm_start else set())
        ),
        "grpo_steps": len(steps),
        "complete": final is not None,
        "references": {
            "random": RANDOM_RETURN, "always_stand": ALWAYS_STAND_RETURN, "optimal": OPTIMAL_RETURN,
        },
    }  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _plot(evals, out / "learning_curve.png")


def _plot(evals: Iterable[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted((e["step"], e["return"], e["hands"]) for e in evals)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if points:
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", color="C0",
                label="evaluation return")  # fmt: skip
        for step, ret, hands in points:
            ax.annotate(f"{hands}", (step, ret), textcoords="offset points", xytext=(0, 6),
                        ha="center", fontsize=7)  # fmt: skip
    for value, name, style in (
        (RANDOM_RETURN, "random", ":"),
        (ALWAYS_STAND_RETURN, "always stand", "--"),
        (OPTIMAL_RETURN, "optimal", "-."),
    ):
        ax.axhline(value, linestyle=style, color="grey", linewidth=1)
        ax.text(0, value, f" {name} ({value})", va="bottom", fontsize=8, color="grey")
    ax.set_xlabel("GRPO step (0 = warm start)")
    ax.set_ylabel("mean return per hand")
    ax.set_title("Blackjack GRPO, tiny Qwen3 (labels: hands evaluated)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
